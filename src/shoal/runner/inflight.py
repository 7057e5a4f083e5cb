"""What passes between a step still running on the device and the host, without a host sync
(async scheduling): the previous step's sampled tokens become this step's input ids on the
device (`TokenPatch`), and the sampler's results come back to pinned host memory behind an event
(`HostReadback`), so waiting for step n never waits for step n+1, queued after it.

Invariant: everything here is stream-ordered on the current stream. A patch is queued after
the upload of the ids it overwrites and before the forward that reads them; a readback is
queued right after the tensors it copies are computed, and `wait()` blocks on its own event
only. On the CPU every operation completes at once and the same code runs synchronously.
Blocking `.to(cuda)` / `.tolist()` calls synchronise the whole stream, which is why none is
used on the path of a pipelined step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shoal.model.batch import ForwardBatch
from shoal.model.tail_prefill import LayerRows


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: on CUDA through pinned memory and a non-blocking copy (the
    host does not wait for the work queued on the stream), elsewhere a plain copy."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload(values: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """[len(values), len(values[0])] int64 on `device` (`to_device`)."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)


def batch_to_device(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """The host-built `batch` on a CUDA `device`, every tensor through pinned memory and a
    non-blocking copy (a plain `.to(device)` waits for the whole stream: for the step in
    flight too)."""
    moved: dict[int, torch.Tensor] = {}

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if id(t) not in moved:  # (LayerRows may share one tensor between fields)
            moved[id(t)] = to_device(t, device)
        return moved[id(t)]

    tensors = {f.name: move(getattr(batch, f.name)) for f in dataclasses.fields(batch)
               if isinstance(getattr(batch, f.name), torch.Tensor)}
    layer_rows = {layer: LayerRows(move(r.prod), move(r.kv), move(r.full))
                  for layer, r in batch.layer_rows.items()}
    return dataclasses.replace(batch, layer_rows=layer_rows, **tensors)


@dataclass(frozen=True)
class TokenPatch:
    """Input ids that the previous step sampled and the host has not read: row `rows[i]` of
    this step's `input_ids` takes `tokens[sources[i]]` (tokens: [B'] int64 on the device, the
    previous step's samples in its draw order)."""

    rows: tuple[int, ...]
    sources: tuple[int, ...]
    tokens: torch.Tensor

    def apply(self, batch: ForwardBatch) -> None:
        """Write the tokens into the batch's input ids (on the device) in place."""
        self.apply_ids(batch.input_ids)

    def apply_static(self, static: ForwardBatch, dst: torch.Tensor | None, q: int) -> None:
        """The same into a decode graph's static batch (row r is request r)."""
        if q != 1 or dst is not None:
            raise ValueError("TokenPatch: a decode batch only (one row per request)")
        self.apply_ids(static.input_ids)

    def apply_ids(self, input_ids: torch.Tensor) -> None:
        """Write the tokens into `input_ids` ([T] int64 on the device) in place."""
        k = len(self.rows)
        if self.rows == self.sources == tuple(range(k)):  # steady decode: same rows, same order
            input_ids[:k].copy_(self.tokens[:k])
            return
        index = upload([self.rows, self.sources], input_ids.device)  # [2, k]
        input_ids[index[0]] = self.tokens[index[1]]


class HostReadback:
    """Copies of device tensors into host memory, queued now; `wait()` returns them once these
    copies are done (on CUDA: pinned buffers and an event recorded after the copies)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        cuda = any(t.device.type == "cuda" for t in tensors)
        self.host = []
        for t in tensors:
            if t.device.type != "cuda":
                self.host.append(t)
                continue
            buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buffer.copy_(t, non_blocking=True)
            self.host.append(buffer)
        self.event: torch.cuda.Event | None = None
        if cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.host

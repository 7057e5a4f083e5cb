"""Lazy safetensors checkpoint reader with an inventory check.

Owns: reading `config.json`, `model.safetensors.index.json` (weight_map) or a single
`model.safetensors`, validating every shard header up front (so a truncated or corrupt file is
reported by name before any tensor is used), lazy mmap'd tensor access, dtype normalisation, and
`check(config)`, which compares the checkpoint against `checkpoint_inventory(config)`.

Invariant: `get(name)` returns the in-memory dtype of the inventory: F8_E4M3 ->
`torch.float8_e4m3fn`, F8_E8M0 and I8/U8 (packed FP4) -> `torch.uint8` (bit-identical views),
BF16 and F32 unchanged. Every error is a `CheckpointError` (a ValueError) naming the tensor(s)
and file(s) at fault.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import safe_open

from shoal.model.config import ModelConfig
from shoal.model.weights import DISK_DTYPES, checkpoint_inventory, classify, is_optional

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_ITEMSIZE = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1,
             "BF16": 2, "F16": 2, "I16": 2, "U16": 2, "F32": 4, "I32": 4, "U32": 4,
             "F64": 8, "I64": 8, "U64": 8}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint is unreadable or does not match the model; the message names the culprits."""


@dataclass(frozen=True)
class TensorInfo:
    """Header entry of one stored tensor."""

    name: str
    file: str
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]


def read_header(path: Path, fname: str | None = None) -> dict[str, TensorInfo]:
    """Parse and validate a safetensors header: size, JSON, dtypes, offsets inside the file.
    `fname`: the file's name in the checkpoint (default: its base name)."""
    fname = fname or path.name
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{fname}: truncated (shorter than the 8-byte header size)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{fname}: corrupt or truncated header (declares {n} "
                                      f"bytes, file has {size})")
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{fname}: cannot be read ({exc})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{fname}: corrupt header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{fname}: corrupt header (not a JSON object)")
    data_size = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(int(s) for s in entry["shape"])
            begin, end = (int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{fname}: corrupt header entry for tensor {name!r}") from None
        if dtype not in _ITEMSIZE:
            raise CheckpointError(f"{fname}: tensor {name!r} has unsupported dtype {dtype!r}")
        expected = _ITEMSIZE[dtype]
        for s in shape:
            expected *= s
        if end - begin != expected or begin < 0:
            raise CheckpointError(f"{fname}: tensor {name!r} has data_offsets {begin}..{end} "
                                  f"that do not match {dtype}{list(shape)}")
        if end > data_size:
            raise CheckpointError(f"{fname}: truncated: tensor {name!r} ends at byte {end} of the "
                                  f"data section, which has only {data_size} bytes")
        out[name] = TensorInfo(name, fname, dtype, shape)
    return out


def normalise(t: torch.Tensor) -> torch.Tensor:
    """On-disk dtypes -> in-memory ones (bit-identical views): E8M0 and I8 -> uint8."""
    if t.dtype == torch.int8 or t.dtype == torch.float8_e8m0fnu:
        return t.view(torch.uint8)
    return t


@dataclass
class CheckReport:
    """Result of `CheckpointReader.check`; entries are (name, file, detail)."""

    missing: list[str] = field(default_factory=list)
    unknown: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    shape_mismatch: list[tuple[str, str, str]] = field(default_factory=list)
    dtype_mismatch: list[tuple[str, str, str]] = field(default_factory=list)
    checked: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unknown or self.shape_mismatch or self.dtype_mismatch)

    def first(self) -> str:
        """The first problem, on one line (what an error's first line names)."""
        for title, items in (("missing", [(n,) for n in self.missing]),
                             ("unknown", self.unknown), ("shape mismatch", self.shape_mismatch),
                             ("dtype mismatch", self.dtype_mismatch)):
            if items:
                return f"{title}: " + " | ".join(items[0])
        return "none"

    def summary(self, limit: int = 20) -> str:
        lines = []
        for title, items in (("missing", [(n,) for n in self.missing]),
                             ("unknown", self.unknown), ("shape mismatch", self.shape_mismatch),
                             ("dtype mismatch", self.dtype_mismatch)):
            if items:
                lines.append(f"{len(items)} {title}:")
                lines += ["  " + " | ".join(item) for item in items[:limit]]
                if len(items) > limit:
                    lines.append(f"  ... and {len(items) - limit} more")
        return "\n".join(lines) if lines else f"ok: {self.checked} tensors match"


class CheckpointReader:
    """Read a checkpoint directory lazily. Use as a context manager or call `close()`."""

    def __init__(self, path: str | Path, load_config: bool = True) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint: {self.path} is not a directory")
        self.config: ModelConfig | None = None
        if load_config:
            self.config = ModelConfig.from_file(self.path / "config.json")
        self._infos: dict[str, TensorInfo] = {}
        self._handles: dict[str, Any] = {}
        index = self.path / INDEX_FILE
        if index.is_file():
            self._read_index(index)
        elif (self.path / SINGLE_FILE).is_file():
            self._infos = read_header(self.path / SINGLE_FILE)
        else:
            raise CheckpointError(f"checkpoint: {self.path} has neither {INDEX_FILE} nor "
                                  f"{SINGLE_FILE}")
        for fname in sorted({info.file for info in self._infos.values()}):
            self._handle(fname)  # safetensors' own checks of every shard, before any tensor

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except OSError as exc:
            raise CheckpointError(f"{INDEX_FILE}: cannot be read ({exc.strerror})") from None
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{INDEX_FILE}: corrupt index, expected a 'weight_map' "
                                  f"object ({exc!r})") from None
        for name, fname in weight_map.items():
            parts = PurePosixPath(fname).parts if isinstance(fname, str) else ()
            if not parts or PurePosixPath(fname).is_absolute() or ".." in parts:
                raise CheckpointError(f"{INDEX_FILE}: tensor {name!r} maps to {fname!r}, "
                                      "expected a file name inside the checkpoint")
        headers: dict[str, dict[str, TensorInfo]] = {}
        for fname in sorted(set(weight_map.values())):
            shard = self.path / fname
            if not shard.is_file():
                names = [n for n, f in weight_map.items() if f == fname]
                raise CheckpointError(f"{fname}: listed in {INDEX_FILE} for {len(names)} tensors "
                                      f"(e.g. {names[0]!r}) but the file does not exist")
            headers[fname] = read_header(shard, fname)
        seen: dict[str, str] = {}
        for fname, header in headers.items():  # one tensor stored twice: which one is meant?
            for name in header:
                if name in seen:
                    raise CheckpointError(f"tensor {name!r} is stored in both {seen[name]} and "
                                          f"{fname}")
                seen[name] = fname
        for name, fname in weight_map.items():
            info = headers[fname].get(name)
            if info is None:
                raise CheckpointError(f"{fname}: tensor {name!r} is mapped to this file by "
                                      f"{INDEX_FILE} but is not in its header")
            self._infos[name] = info

    # ---- access ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint {self.path}") from None

    def _handle(self, fname: str) -> Any:
        handle = self._handles.get(fname)
        if handle is None:
            try:
                handle = safe_open(str(self.path / fname), framework="pt")
            except Exception as exc:  # safetensors raises its own error type
                raise CheckpointError(f"{fname}: cannot be opened ({exc})") from None
            self._handles[fname] = handle
        return handle

    def get(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """The tensor `name` in its normalised in-memory dtype, on `device`."""
        info = self.info(name)
        try:
            tensor = self._handle(info.file).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{info.file}: tensor {name!r} cannot be read ({exc})") from None
        tensor = normalise(tensor)
        return tensor if torch.device(device).type == "cpu" else tensor.to(device)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- validation -----------------------------------------------------------------------
    def check(self, config: ModelConfig | None = None, raise_on_error: bool = True) -> CheckReport:
        """Compare names, shapes and dtypes with the inventory of `config` (default: own config).

        Raises `CheckpointError` listing the culprits (name | file | detail) unless the report is
        clean or `raise_on_error` is False. Vision tensors are reported as ignored.
        """
        config = config or self.config
        if config is None:
            raise CheckpointError("check: no config given and none was loaded")
        inventory = checkpoint_inventory(config)
        report = CheckReport()
        for name, info in self._infos.items():
            cls = classify(name, inventory)
            if cls.status == "ignored":
                report.ignored.append(name)
                continue
            if cls.status == "unknown" or cls.spec is None:
                report.unknown.append((name, info.file))
                continue
            report.checked += 1
            spec = cls.spec
            if info.shape != spec.shape:
                report.shape_mismatch.append(
                    (name, info.file, f"shape {list(info.shape)}, expected {list(spec.shape)}"))
            if info.dtype not in DISK_DTYPES[spec.kind]:
                report.dtype_mismatch.append(
                    (name, info.file, f"dtype {info.dtype}, expected "
                     f"{' or '.join(DISK_DTYPES[spec.kind])}"))
        report.missing = [n for n in inventory if n not in self._infos and not is_optional(n)]
        if raise_on_error and not report.ok:
            raise CheckpointError(f"checkpoint {self.path} does not match config "
                                  f"{config.name!r} ({report.first()}):\n{report.summary()}")
        return report

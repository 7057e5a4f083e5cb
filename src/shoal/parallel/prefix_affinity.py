"""Prefix affinity: which data-parallel replica has probably cached a request's prompt prefix.
With prefix caching, each replica's cache holds what that replica computed, so a request
sharing a prefix with earlier ones goes to the replica that was sent the longest such prefix,
unless that replica holds more than `slack` requests beyond the least busy candidate (then,
and when no replica matches, the caller's least busy choice takes it, and its prefix).

Keys: the prompt cut into chunks, each hash chained with the ones before it (token ids: the
engine's blocks; a text or a conversation, before the replica tokenizes it: CHARS_PER_TOKEN
characters per token), so a request matches a replica up to its longest chunk prefix that
replica was sent. The table is bounded (least recently used out), and a replica evicts its
own cache on its own: a match is a likelihood, never a promise; outputs never depend on it.
`placed` counts each placement's outcome (the server's /metrics: shoal_affinity_*).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence

CHARS_PER_TOKEN = 4
CAPACITY = 1 << 17  # chunk keys remembered (a 32K-token prompt at block 256 is 128)


class PrefixAffinity:
    def __init__(self, block_size: int, capacity: int = CAPACITY) -> None:
        self.block_size, self.capacity = block_size, capacity
        self._owner: OrderedDict[bytes, int] = OrderedDict()  # chunk key -> replica
        # placements: "matched" (an owner of a prefix took it), "busy" (its owners were over
        # the slack or full), "unmatched" (no replica was sent a prefix of it)
        self.placed: Counter[str] = Counter()

    def keys(self, prompt: Sequence[int] | str | list[dict]) -> list[bytes]:
        """The chained keys of a prompt's full chunks: token ids, a text or messages (none
        for a prompt that is none of them: the engine rejects it, not the placement)."""
        try:
            if isinstance(prompt, str) or (isinstance(prompt, list | tuple) and prompt
                                           and isinstance(prompt[0], dict)):
                text = prompt if isinstance(prompt, str) else json.dumps(
                    prompt, sort_keys=True, ensure_ascii=False)
                data, size, root = text.encode(), self.block_size * CHARS_PER_TOKEN, b"text"
            elif isinstance(prompt, list | tuple):
                data, size, root = array("q", prompt).tobytes(), self.block_size * 8, b"ids"
            else:
                return []
        except (TypeError, ValueError, OverflowError):  # a bad prompt: its replica reports it
            return []
        keys, parent = [], hashlib.blake2b(root, digest_size=16).digest()
        for start in range(0, len(data) - size + 1, size):
            parent = hashlib.blake2b(parent + data[start:start + size], digest_size=16).digest()
            keys.append(parent)
        return keys

    def choose(self, keys: list[bytes], least: int, candidates: Sequence[int],
               held: Sequence[int], slack: int) -> int:
        """The candidate sent the longest prefix of `keys` among those holding at most `slack`
        more requests than `least` (the caller's least busy candidate), else `least`."""
        return self._pick(keys, least, candidates, held, slack)[0]

    def _pick(self, keys: list[bytes], least: int, candidates: Sequence[int],
              held: Sequence[int], slack: int) -> tuple[int, str]:
        outcome = "unmatched"
        for key in reversed(keys):
            rank = self._owner.get(key)
            if rank is not None:
                if rank in candidates and held[rank] <= held[least] + slack:
                    return rank, "matched"
                outcome = "busy"
        return least, outcome

    def prompt_of(self, item: dict) -> Sequence[int] | str | list[dict]:
        """An `LLM.run` item's prompt, as `keys` takes it."""
        for field in ("prompt_token_ids", "prompt", "messages"):
            if item.get(field) is not None:
                return item[field]
        return ""

    def place(self, prompt, least: int, candidates: Sequence[int], held: Sequence[int],
              slack: int) -> int:
        """`choose` for a prompt, recorded: the replica that runs it."""
        keys = self.keys(prompt)
        rank, outcome = self._pick(keys, least, candidates, held, slack)
        self.placed[outcome] += 1
        self.record(keys, rank)
        return rank

    def record(self, keys: list[bytes], rank: int) -> None:
        """`rank` was sent these prefixes (it will cache them)."""
        for key in keys:
            self._owner[key] = rank
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

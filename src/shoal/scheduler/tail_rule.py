"""`TailRule`: which SWA rings of a resume point the tail-only prefill makes exact, and which a
resumed prefill reads (the arithmetic of `model/tail_prefill.decoder_thresholds`, restated
without torch for the scheduler; tests/scheduler/test_prefix_cache.py keeps them equal)."""

from __future__ import annotations

from dataclasses import dataclass

TAIL_MODES = ("full", "staircase", "bounded")


@dataclass(frozen=True)
class TailRule:
    """The tail-only prefill's rows, as far as ring snapshots care (the arithmetic of
    `model/tail_prefill.decoder_thresholds`, restated without torch; a test keeps them equal).

    mode: 'full' | 'staircase' | 'bounded'; window: the SWA window; replay_window: bounded's W;
    num_decoder_layers: layers from the first decoder layer to the last backbone layer."""

    mode: str = "full"
    window: int = 128
    replay_window: int = 140
    num_decoder_layers: int = 0

    def __post_init__(self) -> None:
        if self.mode not in TAIL_MODES:
            raise ValueError(f"TailRule.mode={self.mode!r}: expected one of {TAIL_MODES}")

    def _staircase_full_start(self, k: int, n: int) -> int:
        w, m = self.window, self.num_decoder_layers
        return max(0, n - (w + (m - 2 - k) * (w - 1)))

    def needs_decoder_rings(self, boundary: int, prefill_len: int) -> bool:
        """True if a prefill of `prefill_len` tokens resumed at `boundary` reads a decoder
        layer's SWA key below `boundary` (then the snapshot's decoder rings must be exact)."""
        if not self.num_decoder_layers:
            return False
        w = self.window
        if self.mode == "full":
            return True
        if self.mode == "bounded":
            return max(0, prefill_len - self.replay_window) < boundary
        return self._staircase_full_start(0, prefill_len) < boundary + w - 1

    def decoder_rings_exact(self, boundary: int, prefill_len: int) -> bool:
        """True if, after computing up to `boundary` in a (re)prefill of `prefill_len` tokens,
        every decoder layer's ring holds exact kv for the window below `boundary`."""
        if not self.num_decoder_layers or self.mode == "full":
            return True
        if self.mode == "bounded":
            return prefill_len <= self.replay_window  # no floor: every row ran in full
        w = self.window
        last = self.num_decoder_layers - 1
        kv_start = max(0, self._staircase_full_start(last, prefill_len) - (w - 1))
        return kv_start <= max(0, boundary - w + 1)

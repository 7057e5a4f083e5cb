"""Where a kernel's output is wrong, as a character map: a failing test of a new GPU kernel
prints which rows and column blocks are off, which names the broken fragment or tile layout in
one run rather than only the worst element."""

from __future__ import annotations

from contextlib import contextmanager

import torch


def error_map(got: torch.Tensor, want: torch.Tensor, *, atol: float, rtol: float,
              tile: tuple[int, int] = (1, 8), row_group: int = 1, max_rows: int = 64,
              max_cols: int = 64) -> str:
    """`got` against `want` viewed as [rows, columns] (leading dims flattened), in tiles of
    `tile` elements: '.' every element within atol + rtol |want|, 'x' some over, 'X' all over,
    '#' a non-finite value where the reference has a finite one. At most max_rows x max_cols
    tiles, from the group of `row_group` rows (e.g. a token's heads) holding the first wrong
    element; each line starts with its first row's index."""
    g, w = got.detach().float().cpu(), want.detach().float().cpu()
    g, w = g.reshape(-1, g.shape[-1]), w.reshape(-1, w.shape[-1])
    tr, tc = tile
    rows, cols = -(-g.shape[0] // tr), -(-g.shape[1] // tc)
    over = (g - w).abs() > atol + rtol * w.abs()
    bad_nonfinite = ~torch.isfinite(g) & torch.isfinite(w)
    wrong = (over | bad_nonfinite).any(dim=1).nonzero()
    first = int(wrong[0]) // row_group * row_group // tr if wrong.numel() else 0
    lines = [f"error map: {tr} x {tc} tiles of {tuple(got.shape)} (rows {g.shape[0]}, columns "
             f"{g.shape[1]}); {int(over.sum())} elements over, {int(bad_nonfinite.sum())} "
             "non-finite"]
    lines.append(f"      ('|' every {8 * tc} columns)")
    lines.append("      " + "".join("|" if c % 8 == 0 else " " for c in range(min(cols, max_cols))))
    for r in range(first, min(rows, first + max_rows)):
        chars = []
        for c in range(min(cols, max_cols)):
            o = over[r * tr:(r + 1) * tr, c * tc:(c + 1) * tc]
            nf = bad_nonfinite[r * tr:(r + 1) * tr, c * tc:(c + 1) * tc]
            chars.append("#" if nf.any() else "X" if o.all() else "x" if o.any() else ".")
        lines.append(f"{r * tr:5d} " + "".join(chars))
    return "\n".join(lines)


@contextmanager
def mapped_failure(got: torch.Tensor, want: torch.Tensor, **kwargs):
    """Re-raise an AssertionError of the block with the error map of `got` against `want`."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{error_map(got, want, **kwargs)}") from None

"""The error map the GPU kernel tests print on failure marks exactly the wrong tiles."""

from __future__ import annotations

import pytest
import torch

from support.error_map import error_map, mapped_failure


def test_marks_the_wrong_tiles_from_the_first_wrong_group() -> None:
    want = torch.randn(4, 8, 64)
    got = want.clone()
    got[2, :, 16:24] += 1  # token 2, every head, the third 8-column tile
    got[2, 3, 0] = float("nan")
    got[3, 5, 40] += 1  # one element of a tile
    lines = error_map(got, want, atol=1e-3, rtol=1e-3, tile=(1, 8), row_group=8).splitlines()
    rows = {int(line[:5]): line[6:] for line in lines[3:]}
    assert min(rows) == 16 and len(rows) == 16  # from token 2's first head
    assert rows[16] == "..X....." and rows[19] == "#.X....." and rows[24] == "........"
    assert rows[29] == ".....x.."
    assert "65 elements over, 1 non-finite" in lines[0]


def test_mapped_failure_appends_the_map_and_passes_through_success() -> None:
    want = torch.zeros(2, 16)
    with mapped_failure(want, want, atol=0.0, rtol=0.0):
        pass
    got = want.clone()
    got[1, 9] = 1.0
    with pytest.raises(AssertionError, match=r"(?s)boom.*error map.*\n    1 \.x"):
        with mapped_failure(got, want, atol=0.0, rtol=0.0):
            raise AssertionError("boom")

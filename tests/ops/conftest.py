"""Fixtures of the op tests: one fresh seed per session, shown in every test id."""

from __future__ import annotations

import pytest

from support.rand import BASE_SEED


@pytest.fixture(params=[BASE_SEED], ids=lambda s: f"seed={s}")
def seed(request: pytest.FixtureRequest) -> int:
    print(f"SHOAL_TEST_SEED={request.param}")
    return request.param

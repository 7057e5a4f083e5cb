"""The shared tiny server of a test module (tests/support/live_server.py)."""

from __future__ import annotations

import pytest

from support.live_server import LiveServer


@pytest.fixture(scope="module")
def live():
    server = LiveServer(max_num_seqs=16, max_model_len=256)
    yield server
    server.stop()

"""A live `shoal serve` on tiny (CPU, loopback, a free port) for the server tests."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

API_KEY = "test-key"


class LiveServer:
    def __init__(self, **engine_options) -> None:
        import uvicorn

        from shoal import LLM
        from shoal.serve.app import create_app
        from shoal.serve.engine_loop import Limits

        limits = Limits(engine_options.pop("max_queued_requests", 256),
                        engine_options.pop("max_queued_prompt_tokens", 1 << 20))
        origins = engine_options.pop("allowed_origins", ())
        self.llm = LLM(engine_options.pop("model", "tiny"), device="cpu", **engine_options)
        self.app = create_app(self.llm, model_name="tiny", api_key=API_KEY, limits=limits,
                              allowed_origins=origins)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{self.port}"

    @property
    def engine_loop(self):
        return self.app.state.server.loop

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


# ---- helpers of the server tests

def free_blocks(live: LiveServer) -> int:
    return live.engine_loop.snapshot["kv_blocks_total"] - \
        live.engine_loop.snapshot["kv_blocks_used"]


def wait_idle(live: LiveServer, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        snap = live.engine_loop.snapshot
        if not (snap["running"] or snap["waiting"] or snap["kv_blocks_used"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {live.engine_loop.snapshot}")


def post(live: LiveServer, path: str, body: bytes | dict, key: str | None = API_KEY):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(live.base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_running(live: LiveServer, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not live.engine_loop.snapshot["running"]:
        assert time.time() < deadline, "the request never started"
        time.sleep(0.02)

"""`shoal serve`: its flags and the command (the web stack is imported only when it runs)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from shoal.config import ShoalError


def serve_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model gives it (`shoal serve PATH`, as `vllm serve`)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", dest="api_key", default=None,
                   help="required as 'Authorization: Bearer KEY' on every path but /health, "
                        "/metrics and /version (default: $SHOAL_API_KEY)")
    s.add_argument("--served-model-name", dest="served_model_name", default=None)
    s.add_argument("--max-queued-requests", dest="max_queued_requests", type=int, default=256,
                   help="requests waiting for their first token before new ones get 429")
    s.add_argument("--max-queued-prompt-tokens", dest="max_queued_prompt_tokens", type=int,
                   default=1 << 20)
    s.add_argument("--shutdown-grace", dest="shutdown_grace", type=float, default=30.0,
                   help="seconds to finish in-flight requests on SIGTERM")
    s.add_argument("--allowed-origins", dest="allowed_origins", action="append", default=None,
                   help="an origin browsers may call from (CORS; repeatable, '*' for any; "
                   "default: none)")
    s.add_argument("--root-path", dest="root_path", default="",
                   help="the path prefix a proxy serves this under (ASGI root_path)")
    s.add_argument("--ssl-keyfile", dest="ssl_keyfile", default=None)
    s.add_argument("--ssl-certfile", dest="ssl_certfile", default=None)
    s.add_argument("--uvicorn-log-level", dest="uvicorn_log_level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="info logs every request")


def cmd_serve(args, check_config: Callable[[Any], None], make_llm: Callable[[Any], Any]) -> int:
    import uvicorn

    from shoal.parallel.torchrun import launched_world
    from shoal.serve.app import create_app
    from shoal.serve.engine_loop import Limits

    if launched_world() > 1:
        raise ShoalError("shoal serve runs one front end: use --dp N (one node), not torchrun")
    if args.model_path is not None:
        args.model = args.model_path
    check_config(args)
    llm = make_llm(args)
    name = args.served_model_name or args.model
    app = create_app(llm, model_name=name, api_key=args.api_key or os.environ.get(
        "SHOAL_API_KEY"), limits=Limits(args.max_queued_requests, args.max_queued_prompt_tokens),
        allowed_origins=args.allowed_origins or ())
    scheme = "https" if args.ssl_certfile else "http"
    print(f"shoal serve: {llm.startup_summary()}; serving {name} on {scheme}://{args.host}:"
          f"{args.port}{args.root_path}/v1", file=sys.stderr)
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then re-raises the signal to the
    # handler found at start: make that one a no-op, so a graceful stop exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level, root_path=args.root_path,
                            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                            timeout_graceful_shutdown=args.shutdown_grace)
    graceful_server(uvicorn, config, app.state.server.loop.stop).run()
    print("shoal serve: stopped", file=sys.stderr)
    llm.close()
    return 0


def graceful_server(uvicorn, config, stop_engine: Callable[[], None]):
    """uvicorn's server, whose graceful stop ends the engine loop shortly before the grace runs
    out: the requests still running then end as the server promises (503, or a stream's
    `abort` and error event) before uvicorn cancels their handlers."""

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            grace = self.config.timeout_graceful_shutdown
            loop = asyncio.get_running_loop()
            timer = None if grace is None else loop.call_later(
                max(0.0, grace - min(1.0, grace / 2)),
                lambda: loop.run_in_executor(None, stop_engine))
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

    return Server(config)

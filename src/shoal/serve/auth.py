"""The server's API key check."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from shoal.serve.protocol import error_body

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


def route_path(scope) -> str:
    """The request's path below the app's root path (`--root-path`: uvicorn puts the root path
    in front of the path it hands the app)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class RequireKey:
    """The API key on every path but /health, /metrics and /version (401 otherwise): probes and
    Prometheus scrapers carry no key, and none of them shows a prompt (vLLM keys only /v1).
    Plain ASGI, so that a handler still sees its client disconnect (BaseHTTPMiddleware's
    wrapped `receive` hides it)."""

    def __init__(self, app, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and route_path(scope) not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse(error_body("missing or wrong API key",
                                                   "authentication_error", code=401),
                                        status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

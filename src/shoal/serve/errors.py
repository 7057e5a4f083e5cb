"""The server's errors in OpenAI's body (`{"error": {"message", "type", "param", "code"}}`):
`APIError` raised by the handlers, and a request body that fails validation (400 naming the
field)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from shoal.serve.protocol import error_body


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.status),
                            status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid body"}
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
            where = first.get("loc", ())[-1:]
            return JSONResponse(error_body(
                f"body: invalid JSON ({first.get('ctx', {}).get('error', 'decode error')}"
                + (f" at character {where[0]})" if where else ")"), code=400), status_code=400)
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        return JSONResponse(error_body(f"{param or 'body'}: {first.get('msg')}", param=param,
                                       code=400), status_code=400)

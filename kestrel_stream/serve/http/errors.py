"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status."""
from __future__ import annotations

from starlette.responses import JSONResponse

RETRY_AFTER_S = 1           # a refusal for being full: a generation of a few hundred tokens frees its place about as fast


class APIError(Exception):
    """A request the API refuses; ``status`` is the HTTP status, the rest goes into the error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s      # a refusal for now, not for good: the Retry-After header

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_param(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)

"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from tokenmill.server.protocol import ErrorBody, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message,
                                             type=_TYPES.get(self.status, "error"),
                                             param=self.param, code=self.code or self.status))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status,
                            headers=self.headers)


def invalid(exc: ValueError) -> APIError:
    """Engine and SamplingParams errors read "field: message"; the field becomes `param`."""
    text = str(exc)
    field, sep, _ = text.partition(": ")
    param = field if sep and " " not in field else None
    return APIError(400, text, param=param)

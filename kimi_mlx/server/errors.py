"""HTTP errors of the API: ``ApiError`` (raised by the routes and the request parsing) and its JSON body in the
OpenAI style (``{"error": {"message", "type", "param", "code"}}``), the Anthropic style (``{"type": "error",
"error": {"type", "message"}}``) or the Ollama style (``{"error": "message"}``)."""

from __future__ import annotations

from typing import Optional

# what a client is told of a failure that is not its fault; the server log has the exception
INTERNAL_ERROR = "internal server error (the server log has the details)"
GENERATION_FAILED = "generation failed (the server log has the details)"

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error"}


class ApiError(Exception):
    """An HTTP error for the client: ``status`` (4xx/5xx), ``message``, ``param`` (the request field at fault, as
    ``messages[2].content``), ``code`` (OpenAI's machine-readable code) and extra response ``headers``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def openai_body(self) -> dict:
        kind = OPENAI_TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def ollama_body(self) -> dict:
        return {"error": self.message}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}

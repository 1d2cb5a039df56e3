"""What the server's modules share: the OpenAI-shaped error and the per-app state the routes read."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi.responses import JSONResponse

from kvreplay.server.async_engine import AsyncEngine
from kvreplay.server.config import ServerConfig
from kvreplay.server.formatting import TokenFormatter, error_body
from kvreplay.server.metrics import ServerMetrics

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable_error"}


class ApiError(Exception):
    """An error answered in the OpenAI shape with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = error_body(self.message, _ERROR_TYPES.get(self.status, "server_error"), self.param,
                          self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine
    metrics: ServerMetrics
    formatter: TokenFormatter
    created: int

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.config.served_model_name}'", "model", "model_not_found")

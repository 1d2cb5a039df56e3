"""Server settings (the engine has its own EngineConfig)."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "kvreplay-default"


@dataclass
class ServerConfig:
    """Knobs of the HTTP server.

    Attributes:
        host: address to bind; loopback unless told otherwise.
        port: TCP port (0: any free one).
        served_model_name: the model id clients name in requests and see in /v1/models.
        api_key: when set, every route but /health needs `Authorization: Bearer <api_key>`.
        max_queued_seqs: sequences (prompts x n) admitted and unfinished at most; beyond it
            requests get 429 at once.
        max_request_bytes: largest request body accepted (413 beyond it).
        shutdown_timeout_s: on SIGTERM, how long in-flight requests may run before being aborted.
        debug_endpoints: serve GET /debug/kv (KV pool state and an integrity check).
    """
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = DEFAULT_MODEL_NAME
    api_key: str | None = None
    max_queued_seqs: int = 256
    max_request_bytes: int = 1 << 20
    shutdown_timeout_s: float = 10.0
    debug_endpoints: bool = False

    def __post_init__(self):
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty: give a real key or leave it unset")
        for name in ("max_queued_seqs", "max_request_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s!r}")

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def model_name_for(model: str | None) -> str:
    """The default served name: the file or folder stem of `--model`, else kvreplay-default."""
    return Path(model.rstrip("/")).stem if model else DEFAULT_MODEL_NAME

"""Load the model and run the server under uvicorn until SIGTERM or Ctrl-C."""
from __future__ import annotations

import signal
import sys

import uvicorn

from kvreplay.api import LLM
from kvreplay.config import EngineConfig
from kvreplay.server.app import build_app
from kvreplay.server.async_engine import AsyncEngine
from kvreplay.server.config import ServerConfig


# uvicorn's own deadline, past ours: by then every stream has had its final chunk.
_UVICORN_GRACE_S = 5.0


class _Server(uvicorn.Server):
    """On SIGTERM/Ctrl-C: uvicorn closes the listening socket and waits for open requests; the
    engine admits nothing new (503) and, after `shutdown_timeout_s`, aborts what still runs so
    each client gets a final chunk (finish_reason "abort"); then the app's lifespan stops the
    engine loop and the process exits 0."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout_s: float):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s

    def handle_exit(self, sig, frame):
        if not self.should_exit:
            self.engine.drain(self.shutdown_timeout_s)
        super().handle_exit(sig, frame)


def run_server(engine_config: EngineConfig, config: ServerConfig, access_log: bool = False) -> None:
    print(f"loading {engine_config.model or 'the embedded SmolLM2-135M-Instruct'} ...",
          file=sys.stderr)
    llm = LLM(**{name: getattr(engine_config, name) for name in engine_config.__dataclass_fields__})
    engine = AsyncEngine(llm, max_queued_seqs=config.max_queued_seqs)
    app = build_app(engine, config)
    uvicorn_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                    access_log=access_log,
                                    timeout_graceful_shutdown=config.shutdown_timeout_s + _UVICORN_GRACE_S)
    print(f"serving '{config.served_model_name}' on http://{config.host}:{config.port}/v1",
          file=sys.stderr)
    # uvicorn re-raises the signal that stopped it once it has drained. For SIGTERM that would
    # kill us with status 143 after a clean shutdown, so make the re-raise a no-op: exit 0.
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    _Server(uvicorn_config, engine, config.shutdown_timeout_s).run()

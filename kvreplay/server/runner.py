"""Load the model and run the server under uvicorn until SIGTERM or Ctrl-C."""
from __future__ import annotations

import logging
import signal
import sys
import time

import uvicorn

from kvreplay.api import LLM
from kvreplay.config import EngineConfig
from kvreplay.server import allocator
from kvreplay.server.app import build_app
from kvreplay.server.async_engine import AsyncEngine
from kvreplay.server.config import ServerConfig

logger = logging.getLogger("uvicorn.error")  # where uvicorn says it is shutting down

# uvicorn's own deadline, past ours: by then every stream has had its final chunk.
_UVICORN_GRACE_S = 5.0


class _Server(uvicorn.Server):
    """SIGTERM or Ctrl-C starts a drain; the port stays open meanwhile, so load balancers see
    /health answer 503 (and new requests get 503) rather than a refused connection. In-flight
    requests run on for up to `shutdown_timeout_s`; then the engine cuts what still runs, each
    client getting a final chunk (finish_reason "length", stop_reason "shutdown"). Once every
    admitted request has been answered, uvicorn stops: it closes the port, waits for open
    connections, the app's lifespan stops the engine loop, and the process exits 0. A second
    signal stops uvicorn at once (its own handling: a third Ctrl-C forces the exit)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout_s: float):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self._drain_deadline: float | None = None  # set by the first signal
        self._drain_logged = False

    def handle_exit(self, sig, frame):
        if self._drain_deadline is None:  # not uvicorn's handle_exit: that closes the port now
            self._drain_deadline = time.monotonic() + self.shutdown_timeout_s + _UVICORN_GRACE_S
            self.engine.drain(self.shutdown_timeout_s)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s in uvicorn's main loop: stop serving once a drain has ended."""
        if self._drain_deadline is not None and not self.should_exit:
            if not self._drain_logged:  # not from the signal handler: logging takes locks
                self._drain_logged = True
                logger.info("Draining: /health and new requests answer 503; in-flight requests "
                            "may run %.1f s more", self.shutdown_timeout_s)
            if self.engine.drained or time.monotonic() > self._drain_deadline:
                self.should_exit = True
        return await super().on_tick(counter)


def run_server(engine_config: EngineConfig, config: ServerConfig, access_log: bool = False) -> None:
    if not allocator.use_one_arena():
        logger.debug("mallopt(M_ARENA_MAX) unavailable: the allocator keeps its per-thread arenas")
    llm = LLM(**{name: getattr(engine_config, name) for name in engine_config.__dataclass_fields__})
    allocator.release_free_memory()  # what loading freed (~400 MiB), before the first 256 steps
    engine = AsyncEngine(llm, max_queued_seqs=config.max_queued_seqs,
                         max_seqs_per_request=config.max_seqs_per_request,
                         max_prompt_bytes=config.max_prompt_bytes,
                         tokenize_nice=config.tokenize_nice)
    app = build_app(engine, config)
    uvicorn_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                    access_log=access_log,
                                    timeout_graceful_shutdown=config.shutdown_timeout_s + _UVICORN_GRACE_S)
    print(f"serving '{config.served_model_name}' on http://{config.host}:{config.port}/v1"
          + (f"; web console at http://{config.host}:{config.port}/console" if config.console else ""),
          file=sys.stderr)
    # uvicorn re-raises the signal that stopped it once it has drained. For SIGTERM that would
    # kill us with status 143 after a clean shutdown, so make the re-raise a no-op: exit 0.
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    _Server(uvicorn_config, engine, config.shutdown_timeout_s).run()

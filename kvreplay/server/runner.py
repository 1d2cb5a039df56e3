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


def run_server(engine_config: EngineConfig, config: ServerConfig, access_log: bool = False) -> None:
    if not allocator.use_one_arena():
        logger.debug("mallopt(M_ARENA_MAX) unavailable: the allocator keeps its per-thread arenas")
    llm = LLM(**{name: getattr(engine_config, name) for name in engine_config.__dataclass_fields__})
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

"""`kvreplay serve`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import os
import sys


def register(subparsers) -> None:
    from kvreplay.commands.flags import add_engine_args
    from kvreplay.server.config import ServerConfig
    defaults = ServerConfig()
    serve = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve POST /v1/chat/completions and /v1/completions (streamed or not), "
                    "GET /v1/models, /health and /metrics. Binds 127.0.0.1 unless --host says "
                    "otherwise; Ctrl-C or SIGTERM finishes in-flight requests and exits.")
    group = serve.add_argument_group("server")
    group.add_argument("--host", default=defaults.host, help="address to bind (default: %(default)s)")
    group.add_argument("--port", type=int, default=defaults.port, help="TCP port (default: %(default)s)")
    group.add_argument("--served-model-name", default=None,
                       help="model id for clients (default: kvreplay-default, or the stem of --model)")
    group.add_argument("--api-key", default=os.environ.get("KVREPLAY_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on every route but /health "
                            "(default: $KVREPLAY_API_KEY, else no key)")
    group.add_argument("--max-queued-seqs", type=int, default=defaults.max_queued_seqs,
                       help="sequences (prompts x n) admitted at once; more get 429 "
                            "(default: %(default)s)")
    group.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes,
                       help="largest request body (default: %(default)s)")
    group.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout_s,
                       help="seconds in-flight requests may finish after SIGTERM before they are "
                            "aborted (default: %(default)s)")
    group.add_argument("--debug-endpoints", action="store_true",
                       help="serve GET /debug/kv (KV pool state and integrity check)")
    group.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_engine_args(serve)
    serve.set_defaults(func=run_serve)


def run_serve(args) -> int:
    from kvreplay.commands.flags import engine_config_from_args
    from kvreplay.server.config import ServerConfig, model_name_for
    config = ServerConfig(host=args.host, port=args.port,
                          served_model_name=args.served_model_name or model_name_for(args.model),
                          api_key=args.api_key, max_queued_seqs=args.max_queued_seqs,
                          max_request_bytes=args.max_request_bytes,
                          shutdown_timeout_s=args.shutdown_timeout,
                          debug_endpoints=args.debug_endpoints)
    engine_config = engine_config_from_args(args)
    if not config.is_loopback and not config.api_key:
        print(f"warning: serving on {config.host} without --api-key: anyone who can reach this "
              f"port can use the model", file=sys.stderr)

    from kvreplay.server.runner import run_server
    run_server(engine_config, config, access_log=args.access_log)
    return 0

"""`kvreplay serve`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import os
import sys


def register(subparsers) -> None:
    from kvreplay.commands.flags import add_engine_args, add_flags
    from kvreplay.server.config import ServerConfig
    serve = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve POST /v1/chat/completions and /v1/completions (streamed or not), "
                    "/v1/tokenize and /v1/detokenize, GET /v1/models, /health, /version, "
                    "/metrics, the OpenAPI docs at /docs and the web console at /console "
                    "(with GET /v1/kv/state, its KV map). Binds 127.0.0.1 unless --host says "
                    "otherwise; Ctrl-C or SIGTERM finishes in-flight requests and exits.")
    group = serve.add_argument_group("server")
    add_flags(group, ServerConfig)
    group.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_engine_args(serve)
    serve.set_defaults(func=run_serve)


def run_serve(args) -> int:
    from kvreplay.commands.flags import config_from_args, engine_config_from_args
    from kvreplay.server.config import API_KEY_ENV, ServerConfig, model_name_for
    config = config_from_args(
        ServerConfig, args, served_model_name=args.served_model_name or model_name_for(args.model),
        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV))
    engine_config = engine_config_from_args(args)
    if not config.is_loopback and not config.api_key:
        print(f"warning: serving on {config.host} without --api-key: anyone who can reach this "
              f"port can use the model", file=sys.stderr)

    if config.replicas:
        try:
            from kvreplay.server.replicas import run_replicas
        except ImportError as exc:
            print(f"error: --replicas needs Ray Serve ({exc.name} is missing): "
                  f"pip install 'kvreplay[serve]'", file=sys.stderr)
            return 2
        run_replicas(engine_config, config)
        return 0
    from kvreplay.server.runner import run_server
    run_server(engine_config, config, access_log=args.access_log)
    return 0

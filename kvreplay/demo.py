"""`make run`: start `kvreplay serve` on 127.0.0.1:8000 with the default model, show it answering
one chat request through the official `openai` client, print how to call it, and keep serving
in the foreground until Ctrl-C.

    python -m kvreplay.demo [--port 8000] [extra `kvreplay serve` flags...]
"""
from __future__ import annotations

import argparse
import json
import sys

from kvreplay.server import launch

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 300.0


def _show_one_answer(base_url: str) -> None:
    from openai import OpenAI
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    question = "In one sentence, what is the capital of France?"
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=48,
        temperature=0)
    print(f"\nmodel:     {model}\nuser:      {question}\nassistant: "
          f"{reply.choices[0].message.content.strip()}")
    print(f"usage:     {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} "
          f"completion tokens; kv counters: {json.dumps(reply.usage.model_extra.get('kv'))}")
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 32})
    print(f"\nThe server keeps running at {base_url}/v1 (OpenAI-compatible). Try:\n\n"
          f"  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"       -d '{body}'\n\n"
          f"  curl {base_url}/metrics\n\n"
          f"or any OpenAI client with base_url={base_url}/v1. Ctrl-C stops it.\n", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvreplay.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    args, serve_args = parser.parse_known_args(argv)
    base_url = f"http://{HOST}:{args.port}"
    serve_args = ["--host", HOST, *serve_args]
    print(f"starting: kvreplay serve --port {args.port} {' '.join(serve_args)}", flush=True)
    server = launch.spawn(serve_args, args.port)
    try:
        try:
            launch.wait_healthy(server, base_url, STARTUP_TIMEOUT_S, poll_s=0.5)
        except launch.ServerStartError as exc:
            raise SystemExit(f"{exc} (is the port already in use? try --port)") from None
        _show_one_answer(base_url)
        return server.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the server too: let it finish cleanly
        return launch.stop(server, already_signalled=True)
    except BaseException:
        launch.stop(server)
        raise


if __name__ == "__main__":
    sys.exit(main())

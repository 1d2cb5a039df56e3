"""Multi-turn chats against `kvreplay serve --replicas`: requests/s and prefix hit rate per
routing mode, each mode in a fresh server (docs/benchmarks.md §4, "Replicas").

Each of `--chats` chats opens with its own `--system-chars` system message (real text: pydoc
slices) and runs `--rounds` rounds; each round resends the whole history plus a new question
(`--output-tokens` greedy tokens back). Every chat runs on its own client thread (a closed loop),
so all chats are in flight at once; replies stream, and TTFT is the time from sending a round to
its first content token. Hit rate: usage.kv.prefix_hit_tokens / prompt_tokens over all requests. Modes (same total CPUs and KV memory):

    prefix       --replicas 2 --replica-threads 1, prefix-affinity routing
    round-robin  --replicas 2 --replica-threads 1 --replica-routing round-robin
    one          --replicas 1 --replica-threads 2, twice the KV memory

Usage:
    python bench/replica_routing.py [--chats 12] [--rounds 4] [--kv-cache-memory 128MiB]
        [--modes prefix,round-robin,one] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import httpx

MODES = {"prefix": (2, 1, "prefix"), "round-robin": (2, 1, "round-robin"), "one": (1, 2, "prefix")}


def _memory_times(memory: str, factor: int) -> str:
    digits = "".join(c for c in memory if c.isdigit())
    return f"{int(digits) * factor}{memory[len(digits):]}"


def _serve(mode: str, args, port: int):
    replicas, threads, routing = MODES[mode]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"replica-bench-{mode}-", suffix=".log", delete=False)
    command = [sys.executable, "-m", "kvreplay", "serve", "--port", str(port), "--replicas", str(replicas),
               "--replica-threads", str(threads), "--replica-routing", routing,
               "--kv-cache-memory", _memory_times(args.kv_cache_memory, 2 // replicas)]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while "replicas (" not in open(log.name).read():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server for {mode} did not start:\n{open(log.name).read()[-3000:]}")
        time.sleep(0.5)
    return process, " ".join(command[1:])


def _chat(url: str, system: str, chat: int, rounds: int, output_tokens: int, results: list) -> None:
    """One chat, streamed: (prompt tokens, prefix-hit tokens, replica, seconds to first token) per round."""
    messages = [{"role": "system", "content": system}]
    with httpx.Client(timeout=600) as client:
        for turn in range(rounds):
            messages.append({"role": "user", "content": f"Chat {chat}, question {turn}: what follows?"})
            sent, first, text, usage = time.perf_counter(), None, [], None
            with client.stream("POST", url, json={"model": "kvreplay-default", "messages": messages,
                                                  "max_tokens": output_tokens, "temperature": 0, "stream": True,
                                                  "stream_options": {"include_usage": True}}) as response:
                response.raise_for_status()
                replica = response.headers.get("x-kvreplay-replica")
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices", []):
                        if choice["delta"].get("content"):
                            first = first or time.perf_counter()
                            text.append(choice["delta"]["content"])
            results.append((usage["kv"]["prompt_tokens"], usage["kv"]["prefix_hit_tokens"], replica,
                            (first or time.perf_counter()) - sent))
            messages.append({"role": "assistant", "content": "".join(text)})


def run_mode(mode: str, args, texts: list[str]) -> dict:
    port = 8800 + list(MODES).index(mode)
    process, command = _serve(mode, args, port)
    try:
        results: list = []
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        threads = [threading.Thread(target=_chat, args=(url, texts[i], i, args.rounds, args.output_tokens, results))
                   for i in range(args.chats)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(timeout=120)
    prompt, hits = sum(r[0] for r in results), sum(r[1] for r in results)
    return {"mode": mode, "command": command, "requests": len(results), "wall_s": round(wall, 1),
            "requests_per_s": round(len(results) / wall, 3), "prompt_tokens": prompt, "hit_tokens": hits,
            "hit_rate": round(hits / prompt, 3), "replicas_used": len({r[2] for r in results}),
            "mean_ttft_s": round(sum(r[3] for r in results) / len(results), 3),
            "p50_ttft_s": round(sorted(r[3] for r in results)[len(results) // 2], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--system-chars", type=int, default=1500)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="128MiB", help="per replica of the 2-replica modes")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json")
    args = parser.parse_args()
    from pydoc_data.topics import topics
    keys = [key for key in sorted(topics) if len(topics[key]) >= args.system_chars]
    texts = [topics[keys[i * 3 % len(keys)]][:args.system_chars] for i in range(args.chats)]
    rows = [run_mode(mode, args, texts) for mode in args.modes.split(",")]
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()

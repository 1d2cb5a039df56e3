"""Inter-token gaps of concurrent streams while another client pastes ~1 MB bodies (issue 39).

Starts a real `kvreplay serve` process on loopback (the default model, bf16, a KV budget that holds
every stream, --max-num-seqs >= the clients), then runs `--clients` streaming chat clients at
once, each asking for `--tokens` tokens (ignore_eos) after a short prompt. Once every stream has
its first token, one more client sends chat bodies whose user message is ~`--paste-bytes` of real
text (the Python docs), one after the other (`--paste-interval` seconds between an answer and
the next paste), until the streams end or `--pastes` were sent. Paste modes (`--modes`, each
with a fresh server):

- off: no pastes (the baseline),
- refused: the shipped server settings: a paste under the 1 MiB body limit is refused by its
  bytes before tokenizing (400 context_length_exceeded), every other paste is 10% larger and
  refused by the body limit (413),
- tokenized: --max-request-bytes and --max-prompt-bytes raised to 4x the paste, so every paste
  is rendered and tokenized (on the server's tokenizing thread) and then refused as longer than
  the context (400).

For each stream: the gaps between consecutive content chunks after its first one, their median
and p99 (linear interpolation), and p99/median, over two windows: "all" (every gap after the
stream's first token: an early stream also sees the steps that prefill the later streams'
prompts) and "steady" (the gaps once every stream has its first token: the window the pastes
run in). Reported per mode and window: the worst stream's p99/median (issue 39's target: under
3x for every stream), how many streams reach it, p50/p99/max over all gaps; the pastes sent with
their status codes and answer times, wall time and output tok/s.
On a 2-core machine the client, the server's event loop, its tokenizing thread and its engine
thread share the cores: the gaps include the OS scheduling them.

Usage:
    python bench/stream_gaps.py [--clients 64] [--tokens 640] [--modes off,refused,tokenized]
        [--paste-bytes 1000000] [--paste-interval 0.5] [--pastes N] [--kv-cache-memory SIZE]
        [--dtype bfloat16] [--serve-args='--tokenize-nice 0'] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import sys
import tempfile
import time
from collections import Counter

import httpx

from kvreplay.server import launch

MODES = ("off", "refused", "tokenized")
CHAT_PATH = "/v1/chat/completions"
# the default model's KV bytes per token in bf16 (2 x 30 layers x 3 KV heads x 64 x 2 bytes)
DEFAULT_KV_BYTES_PER_TOKEN = 23_040
PROMPT_TOKENS_ALLOWANCE = 64   # a short chat prompt, rendered, is ~40 tokens
STARTUP_TIMEOUT_S = 900.0      # a first start compiles the CPU kernels


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def paste_text(num_bytes: int) -> str:
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[key] for key in sorted(topics))
    text = text * (num_bytes // len(text) + 1)
    return text.encode()[:num_bytes].decode(errors="ignore")


def server_args(mode: str, args) -> list[str]:
    """`kvreplay serve` flags for one mode; the port is added by `serve`."""
    kv_bytes = args.kv_cache_memory or str(int(
        args.clients * (PROMPT_TOKENS_ALLOWANCE + args.tokens) * DEFAULT_KV_BYTES_PER_TOKEN / 0.6))
    flags = ["--dtype", args.dtype, "--kv-cache-memory", kv_bytes,
             "--max-num-seqs", str(max(args.clients, 1)), "--max-queued-seqs", str(max(256, args.clients))]
    if args.model:
        flags += ["--model", args.model]
    if mode == "tokenized":
        raised = str(4 * args.paste_bytes)
        flags += ["--max-request-bytes", raised, "--max-prompt-bytes", raised]
    return flags + shlex.split(args.serve_args)


@contextlib.contextmanager
def serve(flags: list[str]):
    """A `kvreplay serve` process on a free loopback port; yields (base URL, log path)."""
    port = launch.free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="stream-gaps-serve-", suffix=".log", delete=False)
    process = launch.spawn(flags, port, log, env={k: v for k, v in os.environ.items() if k != "KVREPLAY_API_KEY"})
    base_url = f"http://127.0.0.1:{port}"
    failed = True
    try:
        try:
            launch.wait_healthy(process, base_url, STARTUP_TIMEOUT_S)
        except launch.ServerStartError as exc:
            raise RuntimeError(f"{exc}: see {log.name}") from None
        yield base_url, log.name
        failed = False
    finally:
        launch.stop(process, timeout_s=60)
        log.close()
        if not failed:  # a failed run keeps its log, named in the error
            os.unlink(log.name)


def kv_capacity_tokens(log_path: str) -> int | None:
    """The KV pool's tokens, read from the server's startup summary."""
    with open(log_path) as handle:
        found = re.search(r"blocks x \d+ tokens = ([\d,]+) tokens", handle.read())
    return int(found.group(1).replace(",", "")) if found else None


async def _stream(client: httpx.AsyncClient, index: int, args, started: asyncio.Event,
                  counter: list[int]) -> dict:
    """One streaming chat: the arrival time of each chunk carrying text, and how it ended."""
    body = {"messages": [{"role": "user", "content": f"Tell me a long story about the number {index}."}],
            "max_tokens": args.tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    record = {"index": index, "times": [], "finish": None, "done": False, "error": None}
    try:
        async with client.stream("POST", CHAT_PATH, json=body) as response:
            if response.status_code != 200:
                record["error"] = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    record["done"] = True
                if not line.startswith("data: {"):
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    record["error"] = payload["error"].get("message")
                for choice in payload.get("choices", ()):
                    if choice["delta"].get("content"):
                        record["times"].append(time.perf_counter())
                        if len(record["times"]) == 1:
                            counter[0] += 1
                            if counter[0] == args.clients:
                                started.set()
                    record["finish"] = choice.get("finish_reason") or record["finish"]
    except httpx.HTTPError as exc:
        record["error"] = repr(exc)
    finally:
        if not record["times"]:  # never started: do not hold the pastes back
            counter[0] += 1
            if counter[0] == args.clients:
                started.set()
    return record


async def _paste(client: httpx.AsyncClient, mode: str, args, started: asyncio.Event,
                 streams_done: asyncio.Event) -> list[dict]:
    """Pastes, one after the other, from the moment every stream has its first token."""
    if mode == "off" or args.pastes == 0:
        return []
    bodies = [json.dumps({"messages": [{"role": "user", "content": paste_text(size)}], "max_tokens": 16}).encode()
              for size in (args.paste_bytes, int(args.paste_bytes * 1.1))]
    await started.wait()
    sent = []
    while not streams_done.is_set() and (args.pastes is None or len(sent) < args.pastes):
        body = bodies[len(sent) % 2]
        begun = time.perf_counter()
        try:
            response = await client.post(CHAT_PATH, content=body, headers={"Content-Type": "application/json"})
            status, code = response.status_code, (response.json().get("error") or {}).get("code")
        except httpx.HTTPError as exc:
            status, code = None, repr(exc)
        sent.append({"bytes": len(body), "status": status, "code": code, "seconds": time.perf_counter() - begun})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(streams_done.wait(), args.paste_interval)
    return sent


async def run_load(base_url: str, mode: str, args) -> dict:
    """The clients and the paster against one server; raw records and wall time."""
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        warm = await client.post(CHAT_PATH, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        warm.raise_for_status()
        started, streams_done, counter = asyncio.Event(), asyncio.Event(), [0]
        begun = time.perf_counter()
        paster = asyncio.create_task(_paste(client, mode, args, started, streams_done))
        streams = asyncio.gather(*(_stream(client, i, args, started, counter) for i in range(args.clients)))
        await started.wait()
        all_started_at = time.perf_counter()
        streams = await streams
        wall = time.perf_counter() - begun
        streams_done.set()
        pastes = await paster
    return {"streams": streams, "pastes": pastes, "wall_s": wall, "all_started_at": all_started_at}


def _gap_stats(times: list[float], since: float | None = None) -> dict:
    """Median, p99 and max of the gaps between consecutive `times` (those ending after `since`)."""
    gaps = [b - a for a, b in zip(times, times[1:]) if since is None or a >= since]
    if not gaps:
        return {"gaps": [], "median_s": None, "p99_s": None, "max_s": None, "ratio": None}
    median, p99 = percentile(gaps, 50), percentile(gaps, 99)
    return {"gaps": gaps, "median_s": median, "p99_s": p99, "max_s": max(gaps),
            "ratio": p99 / median if median > 0 else None}


def summarize(mode: str, raw: dict, target: float = 3.0) -> dict:
    """Per-stream gap statistics and the mode's totals, over every gap after a stream's first
    token ("all") and over the gaps once every stream had its first token ("steady": the others'
    prompts are in, and the pastes run)."""
    per_stream, pooled = [], {"all": [], "steady": []}
    for record in raw["streams"]:
        row = {"index": record["index"], "chunks": len(record["times"]), "finish": record["finish"],
               "error": record["error"] or (None if record["done"] else "no [DONE]")}
        for window, since in (("all", None), ("steady", raw["all_started_at"])):
            stats = _gap_stats(record["times"], since)
            pooled[window] += stats.pop("gaps")
            row.update({f"{window}_{key}": value for key, value in stats.items()})
        per_stream.append(row)
    statuses = Counter(str(p["status"]) + (f" {p['code']}" if p["code"] else "") for p in raw["pastes"])
    paste_seconds = [p["seconds"] for p in raw["pastes"]]
    chunks = sum(s["chunks"] for s in per_stream)
    result = {"mode": mode, "clients": len(per_stream), "wall_s": raw["wall_s"], "target_ratio": target,
              "errors": sum(s["error"] is not None for s in per_stream), "chunks": chunks,
              "output_tok_s": chunks / raw["wall_s"]}
    for window, gaps in pooled.items():
        ratios = [s[f"{window}_ratio"] for s in per_stream if s[f"{window}_ratio"] is not None]
        medians = [s[f"{window}_median_s"] for s in per_stream if s[f"{window}_median_s"] is not None]
        result[window] = {
            "median_of_medians_s": percentile(medians, 50) if medians else None,
            "worst_ratio": max(ratios) if ratios else None,
            "streams_over_target": sum(r >= target for r in ratios),
            "gap_p50_s": percentile(gaps, 50) if gaps else None,
            "gap_p99_s": percentile(gaps, 99) if gaps else None,
            "gap_max_s": max(gaps) if gaps else None}
    result.update(pastes=len(raw["pastes"]), paste_statuses=dict(statuses),
                  paste_answer_median_s=percentile(paste_seconds, 50) if paste_seconds else None,
                  paste_answer_max_s=max(paste_seconds) if paste_seconds else None,
                  streams=per_stream, paste_log=raw["pastes"])
    return result


def run_mode(mode: str, args) -> dict:
    flags = server_args(mode, args)
    with serve(flags) as (base_url, log_path):
        capacity = kv_capacity_tokens(log_path)
        needed = args.clients * (PROMPT_TOKENS_ALLOWANCE + args.tokens)
        if capacity is not None and capacity * 0.7 < needed:
            print(f"warning: the KV pool holds {capacity:,} tokens; the streams need ~{needed:,} under the "
                  f"0.7 admit watermark: raise --kv-cache-memory", file=sys.stderr)
        raw = asyncio.run(run_load(base_url, mode, args))
    result = summarize(mode, raw, args.target)
    result.update(server_flags=flags, kv_capacity_tokens=capacity)
    return result


def _fmt(value, digits=3, unit="") -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def print_table(results: list[dict]) -> None:
    target = results[0]["target_ratio"]
    header = ("mode", "gaps", "streams (errors)", "tokens", "wall s", "out tok/s", "median gap",
              "worst p99/median", f"streams >= {target:g}x", "all gaps p50 / p99 / max", "pastes: status",
              "paste answer median / max")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in results:
        statuses = ", ".join(f"{n}x {status}" for status, n in sorted(r["paste_statuses"].items())) or "-"
        for window in ("all", "steady"):
            w = r[window]
            print(f"| {r['mode']} | {window} | {r['clients']} ({r['errors']}) | {r['chunks']:,} | "
                  f"{r['wall_s']:.1f} | {r['output_tok_s']:.1f} | {_fmt(w['median_of_medians_s'])} s | "
                  f"{_fmt(w['worst_ratio'], 2)}x | {w['streams_over_target']} | {_fmt(w['gap_p50_s'])} / "
                  f"{_fmt(w['gap_p99_s'])} / {_fmt(w['gap_max_s'])} s | {r['pastes']}: {statuses} | "
                  f"{_fmt(r['paste_answer_median_s'])} / {_fmt(r['paste_answer_max_s'])} s |")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64, help="concurrent streams (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=640,
                        help="tokens each stream generates (ignore_eos); 64 streams decode 100-150 tok/s "
                             "together on a shared 2-core CPU, so the default takes ~5 minutes a mode "
                             "(default: %(default)s)")
    parser.add_argument("--modes", default="off,refused,tokenized",
                        help="paste modes, comma-separated, each with a fresh server (default: %(default)s)")
    parser.add_argument("--paste-bytes", type=int, default=1_000_000,
                        help="a paste's text in bytes; every other paste is 10%% larger (default: %(default)s)")
    parser.add_argument("--paste-interval", type=float, default=0.5,
                        help="seconds between a paste's answer and the next paste (default: %(default)s)")
    parser.add_argument("--pastes", type=int, default=None,
                        help="pastes to send at most (default: until the streams end)")
    parser.add_argument("--target", type=float, default=3.0,
                        help="the p99/median gap ratio each stream should stay under (default: %(default)s)")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="the server's KV budget (default: the streams' tokens at the default model's "
                             "bf16 bytes per token, over 0.6 for the watermarks)")
    parser.add_argument("--model", default=None, help="the server's --model (default: its default)")
    parser.add_argument("--serve-args", default="",
                        help="more `kvreplay serve` flags, in one string: --serve-args='--tokenize-nice 0'")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", help="write the results (per stream and per paste too) here")
    args = parser.parse_args(argv)
    args.modes = [mode for mode in args.modes.split(",") if mode]
    if not args.modes or any(mode not in MODES for mode in args.modes):
        parser.error(f"--modes takes {', '.join(MODES)}, comma-separated")
    if args.clients < 1 or args.tokens < 3:
        parser.error("--clients must be at least 1 and --tokens at least 3 (two gaps)")
    if args.paste_bytes < 1 or args.paste_interval < 0 or (args.pastes is not None and args.pastes < 0):
        parser.error("--paste-bytes must be positive, --paste-interval and --pastes not negative")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    results = []
    for mode in args.modes:
        results.append(run_mode(mode, args))
        r = results[-1]
        print(f"{mode}: {r['clients']} streams, {r['errors']} errors, worst p99/median "
              f"{_fmt(r['all']['worst_ratio'], 2)}x (steady {_fmt(r['steady']['worst_ratio'], 2)}x), "
              f"{r['pastes']} pastes, wall {r['wall_s']:.1f} s", flush=True)
    print_table(results)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "runs": results}, handle, indent=1)
    return results


if __name__ == "__main__":
    main()

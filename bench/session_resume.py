"""Returning chat sessions: time to first token of later rounds with the session tier's three
choices side by side (recompute only, load only, the cost model), one process, same requests.

U users each hold a chat of R rounds: round 1 is a `--first-tokens` prompt (real text: pydoc
slices), each later round appends the previous reply and a `--turn-tokens` user message.
`--concurrency` chats are in the engine at once (a closed loop); a user who got a reply thinks
(at least `--think` seconds) and queues again behind every other user, so its next round comes
after all the others' (rounds are served in order, the users round-robin). TTFT is counted
from a round's submission. The pool holds about `--pool-users` users' contexts, so between a
user's rounds the other users' work evicts its blocks from the prefix cache into the session
tier (`kv_tier_memory`, host memory, sized to hold every session). Each mode then brings a
returning user's history back its own way:

- recompute: no tier (today's engine: a returning history is prefilled again),
- load: `kv_tier_choice="load"` (every block the tier holds is loaded),
- cost: `kv_tier_choice="cost"` (load, recompute, or recompute a run's head while its tail is
  read in the background, whichever the measured rates predict fastest).

With `--tier-dir` the tier is on disk only (no host-memory level). `--disk-read-mbps` emulates a
slower device (a network disk): each block file read in the tier's background thread is held
until it has taken at least its bytes at that rate (a sleep, so the engine thread keeps the CPU).

Reported per mode: TTFT (arrival to first token) of round 1 and of rounds 2+ (mean, p50),
tokens loaded and recomputed by rounds 2+, the cost model's predicted vs actual load seconds,
wall time, and greedy-token agreement with the recompute mode.

Usage:
    python bench/session_resume.py [--users 50] [--rounds 4] [--first-tokens 512]
        [--turn-tokens 32] [--output-tokens 16] [--think 0] [--concurrency 4] [--pool-users 6]
        [--tier-memory 2GiB] [--tier-dir DIR [--disk-read-mbps 200]] [--modes recompute,load,cost]
        [--threads 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from collections import deque

import torch


def throttle_disk_reads(bytes_per_second: float) -> None:
    """Make every tier file read take at least its bytes at `bytes_per_second` (a sleep after
    the real read: the emulated device is idle CPU, like a network disk)."""
    from kvreplay.kv import tier_files
    read = tier_files.read_payload

    def slow_read(path, header, offset):
        started = time.perf_counter()
        payload = read(path, header, offset)
        time.sleep(max(0.0, int(header["payload_bytes"]) / bytes_per_second - (time.perf_counter() - started)))
        return payload
    tier_files.read_payload = slow_read


def run_mode(mode: str, histories: list[list[list[int]]], args, pool_bytes: int) -> dict:
    from kvreplay import LLM, SamplingParams
    tier = {} if mode == "recompute" else dict(kv_tier_memory=args.tier_memory) if args.tier_dir is None else \
        dict(kv_tier_memory=0, kv_tier_dir=args.tier_dir, kv_tier_disk=args.tier_disk)
    llm = LLM(dtype=args.dtype, kv_cache_memory=pool_bytes, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_tier_choice=mode, **tier)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    warm = histories[0][0][:64]
    engine.add_request(warm, SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    replies: dict[int, list[list[int]]] = {u: [] for u in range(len(histories))}
    ready = deque((0.0, user, 0) for user in range(len(histories)))  # (ready time, user, round)
    live: dict[str, tuple[int, int, float]] = {}  # request id -> (user, round, submit time)
    seen: set[str] = set()                         # requests whose first token was timed
    ttft = {r: [] for r in range(args.rounds)}
    stats = {r: [] for r in range(args.rounds)}
    start = time.perf_counter()
    while ready or live:
        now = time.perf_counter() - start
        while ready and len(live) < args.concurrency and ready[0][0] <= now:
            _, user, round_index = ready.popleft()
            prompt = list(histories[user][0])
            for earlier in range(round_index):  # the chat so far: replies and the next messages
                prompt += replies[user][earlier] + histories[user][earlier + 1]
            request_id = engine.add_request(prompt, params, request_id=f"u{user}r{round_index}")
            live[request_id] = (user, round_index, time.perf_counter() - start)
        if not live:
            time.sleep(max(0.0, ready[0][0] - now))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for seq in engine.scheduler.running:
            if seq.request_id in live and seq.num_output_tokens and seq.request_id not in seen:
                seen.add(seq.request_id)
                ttft[live[seq.request_id][1]].append(now - live[seq.request_id][2])
        for out in outputs:
            if not out.finished:
                continue
            user, round_index, submitted = live.pop(out.request_id)
            if out.request_id not in seen:  # its first token was also its last
                seen.add(out.request_id)
                ttft[round_index].append(now - submitted)
            replies[user].append(out.token_ids)
            stats[round_index].append(out.stats)
            if round_index + 1 < args.rounds:  # back of the line: every other user goes first
                ready.append((now + args.think, user, round_index + 1))
    wall = time.perf_counter() - start
    later = [t for r in range(1, args.rounds) for t in ttft[r]]
    later_stats = [s for r in range(1, args.rounds) for s in stats[r]]
    costs = engine.tier_loader.costs if engine.tier_loader is not None else None
    result = {
        "mode": mode, "wall_s": wall,
        "ttft_round1_mean_s": statistics.mean(ttft[0]), "ttft_round1_p50_s": statistics.median(ttft[0]),
        "ttft_later_mean_s": statistics.mean(later) if later else None,
        "ttft_later_p50_s": statistics.median(later) if later else None,
        "loaded_tokens": sum(s.tier_loaded_tokens for s in later_stats),
        "overlapped_tokens": sum(s.tier_overlapped_tokens for s in later_stats),
        "recomputed_by_choice_tokens": sum(s.tier_recomputed_tokens for s in later_stats),
        "prefix_hit_tokens": sum(s.prefix_hit_tokens for s in later_stats),
        "predicted_load_s": sum(s.tier_predicted_seconds for s in later_stats),
        "actual_load_s": sum(s.tier_actual_seconds for s in later_stats),
        "tier_memory_bytes": engine.kv.tier_io.tier.memory_used if costs else 0,
        "recompute_tok_s": costs.recompute_tokens_per_second if costs else None,
        "memory_read_s_per_MiB": costs.read_seconds_per_byte["memory"] * 2**20 if costs else None,
        "disk_read_s_per_MiB": costs.read_seconds_per_byte["disk"] * 2**20 if costs and
        "disk" in costs.read_seconds_per_byte else None,
        "replies": replies,
    }
    engine.check_integrity()
    del llm, engine
    gc.collect()
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--first-tokens", type=int, default=512)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--think", type=float, default=0.0,
                        help="seconds at least between a reply and the user's next round (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=4, help="chats in the engine at once")
    parser.add_argument("--pool-users", type=float, default=6,
                        help="the pool holds about this many users' last-round contexts (default: %(default)s)")
    parser.add_argument("--tier-memory", default="2GiB")
    parser.add_argument("--tier-dir", default=None,
                        help="keep the tier on disk here (a fresh subdirectory per mode), no memory level")
    parser.add_argument("--tier-disk", default="8GiB", help="disk budget with --tier-dir (default: %(default)s)")
    parser.add_argument("--disk-read-mbps", type=float, default=None,
                        help="emulate a disk this slow (MB/s) for tier file reads (default: the real one)")
    parser.add_argument("--modes", default="recompute,load,cost")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.users < 1 or args.rounds < 2 or args.concurrency < 1:
        parser.error("--users and --concurrency must be at least 1 and --rounds at least 2")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("recompute", "load", "cost") for m in modes):
        parser.error("--modes takes recompute, load and cost, comma-separated")
    if args.disk_read_mbps is not None and (args.tier_dir is None or args.disk_read_mbps <= 0):
        parser.error("--disk-read-mbps needs --tier-dir and a positive rate")
    if args.disk_read_mbps is not None:
        throttle_disk_reads(args.disk_read_mbps * 1e6)
    torch.set_num_threads(args.threads)

    from kvreplay import LLM
    from kvreplay.bench.workload import corpus_token_ids
    from kvreplay.models.loader import default_model_path, load_tokenizer
    corpus = corpus_token_ids(load_tokenizer(default_model_path()))
    per_user = args.first_tokens + (args.rounds - 1) * args.turn_tokens
    if per_user * args.users > len(corpus):
        parser.error(f"the corpus has {len(corpus):,} tokens: fewer users or shorter prompts")
    histories = []
    for user in range(args.users):
        text = corpus[user * per_user:(user + 1) * per_user]
        turns = [text[:args.first_tokens]] + [
            text[args.first_tokens + i * args.turn_tokens:args.first_tokens + (i + 1) * args.turn_tokens]
            for i in range(args.rounds - 1)]
        histories.append(turns)
    probe = LLM(dtype=args.dtype, kv_cache_memory="16MiB")
    bytes_per_token = probe.engine.kv_bytes_per_token
    del probe
    last_context = per_user + (args.rounds - 1) * args.output_tokens
    pool_bytes = int(args.pool_users * last_context * bytes_per_token)
    print(f"{args.users} users x {args.rounds} rounds, contexts {args.first_tokens}-{last_context} tokens; "
          f"pool {pool_bytes / 2**20:.1f} MiB (~{args.pool_users} users' contexts), tier memory "
          f"{args.tier_memory}", flush=True)
    runs = []
    base_dir = args.tier_dir
    for mode in modes:
        if base_dir is not None:  # each mode starts from an empty tier
            args.tier_dir = tempfile.mkdtemp(prefix=f"{mode}-", dir=base_dir)
        runs.append(run_mode(mode, histories, args, pool_bytes))
        if base_dir is not None:
            shutil.rmtree(args.tier_dir, ignore_errors=True)
        r = runs[-1]
        print(f"{mode}: wall {r['wall_s']:.1f} s, rounds 2+ TTFT mean {r['ttft_later_mean_s']:.3f} s", flush=True)
    reference = runs[0]["replies"]
    header = ("mode", "TTFT r1 mean/p50 s", "TTFT r2+ mean/p50 s", "vs recompute", "loaded tok",
              "of which overlapped", "recomputed by choice",
              "prefix hit tok", "load s predicted/actual", "wall s", "same tokens")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    base = next((r for r in runs if r["mode"] == "recompute"), runs[0])
    for r in runs:
        pairs = [(a, b) for u in reference for a, b in zip(r["replies"][u], reference[u])]
        same = sum(a == b for a, b in pairs) / max(1, len(pairs))
        print(f"| {r['mode']} | {r['ttft_round1_mean_s']:.3f} / {r['ttft_round1_p50_s']:.3f} | "
              f"{r['ttft_later_mean_s']:.3f} / {r['ttft_later_p50_s']:.3f} | "
              f"x{base['ttft_later_mean_s'] / r['ttft_later_mean_s']:.2f} | {r['loaded_tokens']:,} | "
              f"{r['overlapped_tokens']:,} | "
              f"{r['recomputed_by_choice_tokens']:,} | {r['prefix_hit_tokens']:,} | "
              f"{r['predicted_load_s']:.3f} / {r['actual_load_s']:.3f} | {r['wall_s']:.1f} | {same:.2f} |")
    print("rates the cost model ended with: " + "; ".join(
        f"{r['mode']}: recompute {r['recompute_tok_s']:.0f} tok/s, memory read {r['memory_read_s_per_MiB'] * 1e3:.2f} ms/MiB"
        + (f", disk read {r['disk_read_s_per_MiB'] * 1e3:.2f} ms/MiB" if r["disk_read_s_per_MiB"] else "")
        for r in runs if r["recompute_tok_s"] is not None))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": [{k: v for k, v in r.items() if k != "replies"} for r in runs]},
                      f, indent=1)


if __name__ == "__main__":
    main()

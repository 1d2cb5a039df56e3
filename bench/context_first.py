"""Contexts sent ahead of their questions, kept under `replay` at a `resident_ratio`: what the
question round costs with the session tier and without, one process, the same requests.

Each of U users sends a `--context-tokens` prompt (real text: pydoc slices) as a kept session
that ends with its prefill (`max_tokens=1`, `keep=True`): it parks cut to the ratio, its dropped
blocks waiting in the prefix cache's LRU. The pool (`--kv-cache-memory`) holds every parked
session but not their dropped blocks, so the later users' prefills push the earlier ones' dropped
blocks out of the LRU (into the tier, when one is on). Then each user, in the same order, sends
its question (`--question-tokens` more tokens of the text, `continues` the kept session), which
needs the dropped context back, exactly: from the prefix cache if it is still there, else loaded
from the tier, else recomputed (on a sliding-window model's hybrid pool, Gemma 3, the whole
sequence is recomputed). `--concurrency` questions are in the engine at once.

Reported per mode (`none`: no tier; `tier`: `kv_tier_memory`): mean and median time to first
token of the question rounds (from submission), their tokens recomputed by replay, loaded from
the tier and restored from the prefix cache's LRU, wall time of the question phase, and greedy
agreement of the answers with the first mode's.

Usage:
    python bench/context_first.py [--model gemma3-270m] [--users 12] [--context-tokens 2048]
        [--question-tokens 32] [--output-tokens 8] [--resident-ratio 0.1] [--concurrency 2]
        [--kv-cache-memory 64MiB] [--tier-memory 1GiB] [--modes none,tier] [--threads 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch


def run_mode(mode: str, contexts: list[list[int]], questions: list[list[int]], args) -> dict:
    from kvreplay import LLM, SamplingParams
    llm = LLM(model=args.model, dtype=args.dtype, policy="replay", resident_ratio=args.resident_ratio,
              kv_cache_memory=args.kv_cache_memory, kv_tier_memory=args.tier_memory if mode == "tier" else 0)
    engine = llm.engine
    park = SamplingParams(max_tokens=1, temperature=0)
    started = time.perf_counter()
    kept = []
    for context in contexts:  # one at a time: each parks before the next prefills
        kept.append(llm.generate(context, park, keep=True, on_step=lambda e: e.check_integrity()).request_id)
    park_s = time.perf_counter() - started
    assert len(engine.sessions) == len(contexts), \
        f"only {len(engine.sessions)} of {len(contexts)} sessions stayed kept: raise --kv-cache-memory"
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    waiting = list(range(len(contexts)))
    live: dict[str, tuple[int, float]] = {}
    ttft, answers, stats, seen = {}, {}, {}, set()
    start = time.perf_counter()
    while waiting or live:
        while waiting and len(live) < args.concurrency:
            user = waiting.pop(0)
            request_id = engine.add_request(contexts[user] + questions[user], params, continues=kept[user])
            live[request_id] = (user, time.perf_counter())
        outputs = engine.step()
        engine.check_integrity()
        now = time.perf_counter()
        for seq in engine.scheduler.running:
            if seq.request_id in live and seq.num_output_tokens and seq.request_id not in seen:
                seen.add(seq.request_id)
                ttft[live[seq.request_id][0]] = now - live[seq.request_id][1]
        for out in outputs:
            if out.finished:
                user, submitted = live.pop(out.request_id)
                ttft.setdefault(user, now - submitted)
                answers[user], stats[user] = out.token_ids, out.stats
    wall = time.perf_counter() - start
    times = list(ttft.values())
    result = {
        "mode": mode, "park_s": park_s, "questions_wall_s": wall,
        "ttft_mean_s": statistics.mean(times), "ttft_p50_s": statistics.median(times),
        "recomputed_tokens": sum(s.replayed_tokens for s in stats.values()),
        "loaded_tokens": sum(s.tier_loaded_tokens for s in stats.values()),
        "replays": sum(s.replays for s in stats.values()),
        "replay_mismatches": sum(s.replay_mismatches for s in stats.values()),
        "answers": [answers[u] for u in range(len(contexts))],
    }
    assert engine.kv.num_free_blocks == engine.kv.num_blocks or engine.sessions, "blocks leaked"
    del llm, engine
    gc.collect()
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m", help="(default: %(default)s)")
    parser.add_argument("--users", type=int, default=12)
    parser.add_argument("--context-tokens", type=int, default=2048)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--resident-ratio", type=float, default=0.1)
    parser.add_argument("--concurrency", type=int, default=2, help="questions in the engine at once")
    parser.add_argument("--kv-cache-memory", default="64MiB",
                        help="the pool: it must hold every parked session (default: %(default)s)")
    parser.add_argument("--tier-memory", default="1GiB", help="the tier's host memory in mode tier")
    parser.add_argument("--modes", default="none,tier")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.users < 1 or args.concurrency < 1 or args.context_tokens < 64 or args.question_tokens < 1 \
            or args.output_tokens < 1:
        parser.error("--users, --concurrency, --question-tokens and --output-tokens must be at least 1, "
                     "--context-tokens at least 64")
    if not 0 < args.resident_ratio < 1:
        parser.error("--resident-ratio must lie between 0 and 1 (exclusive)")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("none", "tier") for m in modes):
        parser.error("--modes takes none and tier, comma-separated")
    torch.set_num_threads(args.threads)

    from kvreplay.bench.workload import corpus_token_ids
    from kvreplay.models.loader import load_tokenizer
    corpus = corpus_token_ids(load_tokenizer(args.model))
    per_user = args.context_tokens + args.question_tokens
    if per_user * args.users > len(corpus):
        parser.error(f"the corpus has {len(corpus):,} tokens: fewer users or shorter contexts")
    texts = [corpus[u * per_user:(u + 1) * per_user] for u in range(args.users)]
    contexts = [text[:args.context_tokens] for text in texts]
    questions = [text[args.context_tokens:] for text in texts]
    print(f"{args.model}: {args.users} contexts of {args.context_tokens} tokens, replay at r={args.resident_ratio:g}, "
          f"pool {args.kv_cache_memory}, questions of {args.question_tokens} tokens, {args.concurrency} at once",
          flush=True)
    runs = [run_mode(mode, contexts, questions, args) for mode in modes]
    first = runs[0]["answers"]
    print("| mode | question TTFT mean / p50 | recomputed tokens | tier loaded tokens | replays | questions wall "
          "| answers equal to the first mode's |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        same = sum(a == b for a, b in zip(run["answers"], first))
        print(f"| {run['mode']} | {run['ttft_mean_s']:.3f} / {run['ttft_p50_s']:.3f} s | {run['recomputed_tokens']:,} "
              f"| {run['loaded_tokens']:,} | {run['replays']} | {run['questions_wall_s']:.1f} s | {same}/{len(first)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()

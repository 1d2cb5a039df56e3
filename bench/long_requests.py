"""Long requests with a fact to recall, all at once, under a tight KV budget: the whole workload's
wall time and recall per policy, and where the time went.

N requests of ~`--prompt-tokens` tokens of real text (slices of CPython's pydoc_data.topics), each
with "The secret number of <name> is <5 digits>." planted at a seeded depth (10%-90%) and asked for
at the end; each generates `--output-tokens` greedily (ignore_eos). The KV budget holds
`--full-holds` requests' full KV. A request recalls when the first number of its answer is the
planted one. Every policy runs the same requests in one process, one after the other.

A policy is `NAME` (the engine's defaults for every other knob: the point of this bench) or
`NAME:knob=value:knob=value` for any EngineConfig field, e.g. the README's replay example of an
earlier release, `replay:trim=prefill:window_tokens=256:replay_threshold=0.65`.

Time is split per step by its tokens (each prompt token, replayed token and decode row costs the
same share of the step; on a CPU the linear layers dominate): prefill (prompt tokens), replay
(recomputed tokens: replay chunks, resumed ranges), decode (rows that kept their token), redone
(decode rows the need detector threw away, redone after a replay), and detector (time inside the
key index's scoring, measured directly and taken out of the decode share).

Usage:
    python bench/long_requests.py [--requests 24] [--prompt-tokens 3000] [--output-tokens 256]
        [--full-holds 4.5] [--policies full,replay] [--dtype bfloat16] [--threads 2] [--seed 0]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import re
import time

import torch

from kvreplay.bench.quality import NAMES  # the retrieval bench's fact names


def make_requests(tokenizer, corpus: list[int], count: int, prompt_tokens: int, seed: int) -> list[dict]:
    """`count` prompts of `prompt_tokens` tokens, each a distinct slice of the corpus with one fact
    planted at a seeded depth and the question at the end."""
    rng = random.Random(seed)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    stride = (len(corpus) - prompt_tokens) // count
    requests = []
    for i in range(count):
        name, value = NAMES[i % len(NAMES)], str(rng.randrange(10_000, 100_000))
        needle = encode(f"\nThe secret number of {name} is {value}.\n")
        question = encode(f"\n\nQuestion: What is the secret number of {name}?\n"
                          f"Answer: The secret number of {name} is")
        hay = corpus[i * stride:i * stride + prompt_tokens - len(needle) - len(question)]
        depth = rng.uniform(0.1, 0.9)
        at = int(len(hay) * depth)
        requests.append({"prompt": hay[:at] + needle + hay[at:] + question, "answer": value,
                         "depth": round(depth, 3)})
    return requests


def parse_policy(spec: str) -> tuple[str, dict]:
    """"replay:trim=prefill:window_tokens=256" -> ("replay", {"trim": "prefill", "window_tokens": 256})."""
    name, *pairs = spec.split(":")
    knobs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"bad knob {pair!r} in {spec!r}: use NAME:knob=value")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        knobs[key] = value
    return name, knobs


def run_policy(spec: str, budget_bytes: int, requests: list[dict], args) -> dict:
    from kvreplay import LLM, SamplingParams
    name, knobs = parse_policy(spec)
    llm = LLM(dtype=args.dtype, kv_cache_memory=budget_bytes, policy=name, **knobs)
    engine = llm.engine
    batches = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batches.append(schedule())
        return batches[-1]

    engine.scheduler.schedule = recording_schedule
    detector = [0.0]
    index = engine.kv.key_index
    if index is not None:
        scoring = index.max_block_mass

        def timed_scoring(*a, **k):
            started = time.perf_counter()
            try:
                return scoring(*a, **k)
            finally:
                detector[0] += time.perf_counter() - started
        index.max_block_mass = timed_scoring
    warm = engine.add_request(requests[0]["prompt"][:64], SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    del warm
    detector[0] = 0.0
    batches.clear()
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request(r["prompt"], params, request_id=f"r{i}") for i, r in enumerate(requests)]
    seconds = {"prefill": 0.0, "replay": 0.0, "decode": 0.0, "redone": 0.0}
    outputs, peak_running = {}, 0
    fires_before = engine.counters.need_fires
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        replayed_before = sum(s.stats.replayed_tokens for s in engine.scheduler.running)
        fired_before = engine.counters.need_fires
        step_start = time.perf_counter()
        results = engine.step()
        elapsed = time.perf_counter() - step_start
        batch = batches[-1]
        batches.clear()
        fired = engine.counters.need_fires - fired_before
        chunk_tokens = sum(n for _, n in batch.prefills)
        replayed = sum(r.num_tokens for r in batch.replays) + max(0, min(chunk_tokens, sum(
            s.stats.replayed_tokens for s in engine.scheduler.running) - replayed_before))
        layered = sum(seq.layered.end - seq.layered.start for seq, _ in batch.layers if seq.layered)
        parts = {"prefill": chunk_tokens + sum(r.num_tokens for r in batch.replays) - replayed + layered,
                 "replay": replayed, "decode": len(batch.decodes) - fired, "redone": fired}
        total = sum(parts.values()) or 1
        for key, tokens in parts.items():
            seconds[key] += elapsed * tokens / total
        peak_running = max(peak_running, engine.num_running)
        for out in results:
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
    wall = time.perf_counter() - start
    seconds["decode"] -= detector[0]
    seconds["detector"] = detector[0]
    recalled = []
    for i, request in zip(ids, requests):
        found = re.search(r"\d+", outputs[i].text)
        recalled.append(bool(found) and found.group() == request["answer"])
    stats = [outputs[i].stats for i in ids]
    prompt_tokens = sum(len(r["prompt"]) for r in requests)
    result = {
        "policy": spec, "wall_s": wall, "recall": sum(recalled), "requests": len(requests),
        "missed_depths": [r["depth"] for r, ok in zip(requests, recalled) if not ok],
        "seconds": seconds, "peak_running": peak_running,
        "pauses": sum(s.pauses for s in stats), "replays": sum(s.replays for s in stats),
        "replayed_tokens": sum(s.replayed_tokens for s in stats),
        "replayed_share_of_prompts": sum(s.replayed_tokens for s in stats) / prompt_tokens,
        "need_fires": engine.counters.need_fires - fires_before,
        "config": {k: (str(v) if not isinstance(v, (int, float, str, bool, type(None))) else v)
                   for k, v in vars(engine.config).items()
                   if k in ("policy", "trim", "window_tokens", "replay_threshold", "need_layers",
                            "heavy_tokens", "resident_ratio", "sink_tokens")},
        "tokens": {i: outputs[i].token_ids for i in ids},
    }
    del llm, engine
    gc.collect()
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--full-holds", type=float, default=4.5,
                        help="the budget in requests' full KV (default: %(default)s)")
    parser.add_argument("--policies", default="full,replay",
                        help="comma-separated NAME or NAME:knob=value:... (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from kvreplay import LLM
    from kvreplay.bench.workload import corpus_token_ids
    probe = LLM(dtype=args.dtype, kv_cache_memory="16MiB")
    bytes_per_token, tokenizer = probe.engine.kv_bytes_per_token, probe.tokenizer
    del probe
    requests = make_requests(tokenizer, corpus_token_ids(tokenizer), args.requests, args.prompt_tokens,
                             args.seed)
    budget = int(args.full_holds * (args.prompt_tokens + args.output_tokens) * bytes_per_token)
    runs = []
    for spec in args.policies.split(","):
        print(f"{spec}: budget {budget / 2**20:.1f} MiB ({args.full_holds} requests of full KV)", flush=True)
        runs.append(run_policy(spec, budget, requests, args))
        r = runs[-1]
        print(f"  wall {r['wall_s']:.1f} s, recall {r['recall']}/{r['requests']}", flush=True)
    base = runs[0]
    header = ("policy", "wall s", "x first", "recall", "prefill s", "replay s", "decode s", "redone s",
              "detector s", "peak running", "pauses", "replays", "replayed tok (share of prompts)",
              "need fires", "same tokens as first")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in runs:
        s = r["seconds"]
        same = sum(r["tokens"][k] == base["tokens"][k] for k in base["tokens"])
        print(f"| {r['policy']} | {r['wall_s']:.1f} | {base['wall_s'] / r['wall_s']:.2f}x | "
              f"{r['recall']}/{r['requests']} | {s['prefill']:.1f} | {s['replay']:.1f} | {s['decode']:.1f} | "
              f"{s['redone']:.1f} | {s['detector']:.1f} | {r['peak_running']} | {r['pauses']} | "
              f"{r['replays']} | {r['replayed_tokens']} ({r['replayed_share_of_prompts']:.1%}) | "
              f"{r['need_fires']} | {same}/{len(base['tokens'])} |")
    for r in runs:
        print(f"{r['policy']}: {r['config']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": [{k: v for k, v in r.items() if k != "tokens"}
                                                    for r in runs]}, f, indent=1)


if __name__ == "__main__":
    main()

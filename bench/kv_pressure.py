"""Pause/replay under KV pressure: protected zones against dropping whole sequences.

Usage:
    python bench/kv_pressure.py [--requests 32] [--system-tokens 500] [--user-tokens 1000]
        [--max-tokens 128] [--budget-requests 6] [--watermarks 0.6,0.95,0.95]
        [--configs protected+cache,recompute+cache,protected,recompute] [--json out.json]

Every request is a chat: one shared system message of about --system-tokens tokens (the
protected zone, found from the chat template) and its own user message of about --user-tokens,
answered greedily for exactly --max-tokens tokens. The KV budget holds about --budget-requests
whole requests. Each config runs in a fresh engine, all requests submitted at once:

    protected   a pause keeps the system span and sinks, drops the rest (kvreplay's `full`)
    recompute   a pause drops the whole sequence (vLLM's recompute preemption)
    +cache      with the prefix cache (dropped full blocks stay cached until evicted)

Reported: wall time, output tokens/s, pauses, replays, replayed/dropped/prefix-hit tokens, peak
blocks, and how many outputs equal the first config's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _conversations(tokenizer, num_requests: int, system_tokens: int, user_tokens: int):
    from pydoc_data.topics import topics
    ids = tokenizer("\n\n".join(topics[k] for k in sorted(topics))).input_ids
    system = tokenizer.decode(ids[:system_tokens])
    step = (len(ids) - system_tokens - user_tokens) // num_requests
    return [[{"role": "system", "content": system},
             {"role": "user", "content": tokenizer.decode(
                 ids[system_tokens + i * step:system_tokens + i * step + user_tokens])}]
            for i in range(num_requests)]


def run(config: str, args, conversations, budget_bytes: int) -> dict:
    from kvreplay import LLM, SamplingParams
    llm = LLM(dtype=args.dtype, kv_cache_memory=budget_bytes, watermarks=args.watermarks,
              enable_prefix_caching=config.endswith("+cache"),
              pause_mode=config.split("+")[0], max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    seconds = time.perf_counter() - start
    stats = [o.stats for o in outputs]
    total = {name: sum(getattr(s, name) for s in stats)
             for name in ("prompt_tokens", "completion_tokens", "pauses", "preemptions", "replays",
                          "replayed_tokens", "dropped_tokens", "prefix_hit_tokens")}
    kv = llm.engine.kv
    return {"config": config, "seconds": seconds,
            "output_tokens_per_s": total["completion_tokens"] / seconds,
            "total_tokens_per_s": (total["prompt_tokens"] + total["completion_tokens"]) / seconds,
            "peak_used_blocks": kv.peak_used_blocks, "num_blocks": kv.num_blocks,
            "steps": llm.engine.counters.steps, **total,
            "token_ids": [o.token_ids for o in outputs]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=500)
    parser.add_argument("--user-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budget-requests", type=float, default=6.0,
                        help="KV budget in whole requests (system + user + output tokens)")
    parser.add_argument("--watermarks", default="0.6,0.95,0.95")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--configs", default="protected+cache,recompute+cache,protected,recompute")
    parser.add_argument("--json", default=None, help="write the results here (after every config)")
    args = parser.parse_args()

    import torch
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    from kvreplay import LLM
    probe = LLM(dtype=args.dtype, kv_cache_memory="16MiB")
    conversations = _conversations(probe.tokenizer, args.requests, args.system_tokens, args.user_tokens)
    prompt_tokens = [len(probe.chat_prompt_ids(c)) for c in conversations]
    system_span = probe.system_span_tokens(conversations[0])
    request_tokens = max(prompt_tokens) + args.max_tokens
    budget_bytes = int(args.budget_requests * request_tokens * probe.engine.kv_bytes_per_token)
    del probe
    print(f"{args.requests} requests: prompts {min(prompt_tokens)}-{max(prompt_tokens)} tokens "
          f"(system span {system_span}), {args.max_tokens} output tokens; budget "
          f"{budget_bytes / 2**20:.1f} MiB = {args.budget_requests:g} requests of {request_tokens} "
          f"tokens; watermarks {args.watermarks}; {args.dtype}", flush=True)
    results = []
    for config in args.configs.split(","):
        result = run(config, args, conversations, budget_bytes)
        result["same_outputs_as_first"] = sum(
            a == b for a, b in zip(result["token_ids"], (results or [result])[0]["token_ids"]))
        results.append(result)
        print(f"{config:>16}: {result['seconds']:7.1f} s  {result['output_tokens_per_s']:6.2f} out tok/s  "
              f"pauses {result['pauses']:3d}  replays {result['replays']:3d}  replayed "
              f"{result['replayed_tokens']:6d}  dropped {result['dropped_tokens']:6d}  prefix hits "
              f"{result['prefix_hit_tokens']:6d}  peak {result['peak_used_blocks']}/{result['num_blocks']} "
              f"blocks  same outputs {result['same_outputs_as_first']}/{args.requests}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "budget_bytes": budget_bytes,
                           "results": [{k: v for k, v in r.items() if k != "token_ids"} for r in results]},
                          f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

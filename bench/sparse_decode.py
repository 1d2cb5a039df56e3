"""Decode-step time and attention time per step at a long context: full against the cold tier
with and without a sparse budget (issue 5), side by side in one process.

For each configuration: `--batch` prompts of `--context` real-text tokens are prefilled (bf16),
then `--steps` decode steps are timed one by one. Attention time is the time spent inside
`paged_attention` over all layers of a step (a timing wrapper around it); the dequantization of
cold blocks is inside it. Medians over the timed steps.

Usage:
    python bench/sparse_decode.py [--context 6144] [--batch 4] [--steps 16]
        [--configs full,sparse:int8:none,sparse:int8:1024,sparse:int4:1024,sparse:fp8:1024]
        [--window-tokens 512] [--threads 2] [--json out.json]

A config is `policy:cold_dtype:sparse_budget[:resident_ratio]`; a fourth field caps each
sequence's resident KV (replay+cold drops its least important cold blocks; the need detector
then reads layers 20-23), e.g. `replay+cold:int8:1024:0.5`.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch


def run_config(spec: str, prompts: list[list[int]], args) -> dict:
    import kvreplay.models.llama as llama
    from kvreplay import LLM, SamplingParams
    parts = spec.split(":")
    policy = parts[0]
    knobs = {}
    if policy != "full":
        knobs = {"cold_dtype": parts[1], "sparse_budget": None if parts[2] == "none" else int(parts[2])}
    if len(parts) > 3:  # replay+cold:int8:1024:0.5 -> a per-sequence resident cap
        knobs |= {"resident_ratio": float(parts[3]), "need_layers": "20-23"}
    tokens = args.batch * (args.context + args.steps + 2)
    llm = LLM(dtype="bfloat16", kv_cache_memory=int(tokens * 23040 * 1.3), policy=policy,
              window_tokens=args.window_tokens, enable_prefix_caching=False, **knobs)
    engine = llm.engine
    original = llama.paged_attention
    spent = [0.0]

    def timed(*a, **k):
        start = time.perf_counter()
        out = original(*a, **k)
        spent[0] += time.perf_counter() - start
        return out

    params = SamplingParams(max_tokens=args.steps + 2, temperature=0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(s.num_uncomputed_tokens > 1 or s.num_output_tokens < 2
              for r in engine.requests.values() for s in r.seqs):
        engine.step()  # prefill, first token, and the step that demotes the middle
    step_times, attention_times = [], []
    llama.paged_attention = timed
    try:
        while engine.has_unfinished_requests():
            spent[0] = 0.0
            start = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - start)
            attention_times.append(spent[0])
    finally:
        llama.paged_attention = original
    kv = engine.kv
    seq_bytes = [kv.resident_bytes(s.seq_id) for r in engine.requests.values() for s in r.seqs]
    result = {"config": spec, "step_ms": 1000 * statistics.median(step_times),
              "attention_ms": 1000 * statistics.median(attention_times),
              "dequant_s": engine.counters.dequant_seconds,
              "selected": engine.counters.sparse_selected_blocks,
              "candidates": engine.counters.sparse_candidate_blocks,
              "peak_pool_blocks": kv.peak_used_blocks, "peak_cold_bytes": kv.peak_cold_bytes,
              "resident_bytes_per_seq": seq_bytes}
    del llm, engine
    gc.collect()
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=6144)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--configs", default="full,sparse:int8:none,sparse:int8:1024,sparse:int4:1024,sparse:fp8:1024")
    parser.add_argument("--window-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvreplay.bench.workload import corpus_token_ids
    from kvreplay.models.loader import default_model_path, load_tokenizer
    corpus = corpus_token_ids(load_tokenizer(default_model_path()))
    stride = (len(corpus) - args.context) // args.batch
    prompts = [corpus[i * stride:i * stride + args.context] for i in range(args.batch)]
    results = []
    for spec in args.configs.split(","):
        results.append(run_config(spec, prompts, args))
        r = results[-1]
        print(f"{spec}: step {r['step_ms']:.1f} ms, attention {r['attention_ms']:.1f} ms, "
              f"selected/candidate {r['selected']}/{r['candidates']}", flush=True)
    base = results[0]
    print("| config | decode step ms | attention ms / step | attention vs first | sparse hit rate | dequant s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        rate = f"{r['selected'] / r['candidates']:.2f}" if r["candidates"] else "-"
        print(f"| {r['config']} | {r['step_ms']:.1f} | {r['attention_ms']:.1f} | "
              f"{r['attention_ms'] / base['attention_ms']:.2f}x | {rate} | {r['dequant_s']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

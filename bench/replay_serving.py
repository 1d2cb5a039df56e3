"""Long requests under a tight KV budget: `full` against `replay` (and optionally `window`), one run.

N requests of ~`--prompt-tokens` real-text tokens (pydoc slices) arrive at once; each generates
`--output-tokens` greedily. The budget is sized so that `full` holds at most `--full-holds` of them
at once. Every policy runs the same requests in the same process, one after the other.

Reported per policy:
- decode tok/s: decode tokens of decode-only steps / time of those steps (the aggregate decode
  rate once prompts are in; steps with prefill, replay or layered-prefill work are left out of
  both sides), and that rate split in two:
  while requests wait (the engine at capacity: admission is what stops them) and once none waits
  (the drain: the batch shrinks as requests finish),
- output tok/s: all output tokens / wall time of the run (prefill and replays included),
- time to first token (all requests arrive at the start): mean, median and last,
- mean decode batch, peak running sequences, pauses, replays, replayed tokens and their share of
  all processed tokens (prompt + replayed + output), approximate tokens,
- agreement with `full`: the fraction of requests whose output equals full's exactly, and the
  mean matching-prefix length.

Usage:
    python bench/replay_serving.py [--requests 16] [--prompt-tokens 3000] [--output-tokens 64]
        [--full-holds 4] [--policies full,replay,replay/layered] [--window-tokens 256] [--trim prefill]
        [--replay-threshold 0.8] [--need-layers 20-23] [--heavy-tokens 32] [--resident-ratio 0.25]
        [--watermarks 0.6,0.7,0.85] [--threads 2] [--device cuda] [--json out.json]
        [--timeline steps.jsonl]  (one line per step and policy: decodes, prefill and replay
                                   tokens, layers of layered prefills, pool use, running,
                                   waiting, seconds)
    A policy may carry a variant: POLICY/layered computes prompts whose middle is dropped after
    prefill one layer at a time (LLM(layered_prefill=True)); POLICY/chunked in token chunks;
    POLICY/tier adds the session tier (kv_tier_memory=--tier-memory, default 2GiB): dropped
    blocks evicted from the prefix cache are loaded back instead of replayed when cheaper.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch


def run_policy(name: str, budget_bytes: int, prompts: list[list[int]], args, timeline=None) -> dict:
    from kvreplay import LLM, SamplingParams
    policy, _, variant = name.partition("/")
    if variant not in ("", "layered", "chunked", "tier"):
        raise SystemExit(f"unknown variant {variant!r} in {name!r}: use POLICY, POLICY/layered, "
                         "POLICY/chunked or POLICY/tier")
    layered = args.layered_prefill if variant in ("", "tier") else variant == "layered"
    llm = LLM(dtype=args.dtype, device=args.device, kv_cache_memory=budget_bytes, policy=policy, trim=args.trim,
              window_tokens=args.window_tokens, replay_threshold=args.replay_threshold,
              need_layers=args.need_layers, heavy_tokens=args.heavy_tokens,
              resident_ratio=args.resident_ratio, max_num_seqs=args.max_num_seqs,
              layered_prefill=layered, kv_tier_memory=args.tier_memory if variant == "tier" else 0,
              **({"watermarks": args.watermarks} if args.watermarks else {}))
    engine = llm.engine
    batches = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        batches.append(batch)
        return batch

    engine.scheduler.schedule = recording_schedule
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    warm = engine.add_request(prompts[0][:64], SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    del warm
    batches.clear()
    ids = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    first_token = {}  # request -> seconds from the start to its first output token
    outputs = {}
    decode_time = decode_tokens = decode_steps = 0
    phases = {"waiting": [0, 0.0, 0], "drain": [0, 0.0, 0]}  # decode tokens, seconds, steps
    peak_running = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        waiting = engine.num_waiting
        step_start = time.perf_counter()
        results = engine.step()
        elapsed = time.perf_counter() - step_start
        batch = batches[-1] if batches else None
        if batch is not None and batch.decodes and not batch.prefills and not batch.replays \
                and not batch.layers:
            decode_time += elapsed
            decode_tokens += len(batch.decodes)
            decode_steps += 1
            phase = phases["waiting" if waiting else "drain"]
            phase[0] += len(batch.decodes)
            phase[1] += elapsed
            phase[2] += 1
        if timeline is not None and batch is not None:
            timeline.write(json.dumps({
                "policy": name, "t": round(step_start - start, 4), "seconds": round(elapsed, 5),
                "decodes": len(batch.decodes), "prefill_tokens": sum(n for _, n in batch.prefills),
                "replay_tokens": sum(r.num_tokens for r in batch.replays),
                "layers": sum(len(layers) for _, layers in batch.layers),  # of layered prefills
                "pool_used": round(engine.kv.num_used_blocks / engine.kv.num_blocks, 4),
                "paused": len(batch.paused), "running": engine.num_running,
                "waiting": engine.num_waiting}) + "\n")
        peak_running = max(peak_running, engine.num_running)
        now = time.perf_counter() - start
        for seq in engine.scheduler.running:
            if seq.num_output_tokens and seq.request_id not in first_token:
                first_token[seq.request_id] = now
        for out in results:
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
        batches.clear()
    wall = time.perf_counter() - start
    stats = [outputs[i].stats for i in ids]
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(outputs[i].token_ids) for i in ids)
    replayed = sum(s.replayed_tokens for s in stats)
    ttft = sorted(first_token.get(i, wall) for i in ids)
    result = {
        "policy": name, "wall_s": wall,
        "ttft_mean_s": sum(ttft) / len(ttft), "ttft_p50_s": ttft[len(ttft) // 2], "ttft_max_s": ttft[-1], "decode_tok_s": decode_tokens / decode_time if decode_time else None,
        "output_tok_s": output_tokens / wall, "mean_decode_batch": decode_tokens / max(1, decode_steps),
        **{f"{name}_{key}": value for name, (tokens, seconds, steps) in phases.items()
           for key, value in (("decode_tok_s", tokens / seconds if seconds else None),
                              ("mean_batch", tokens / max(1, steps)), ("steps", steps))},
        "peak_running": peak_running, "pauses": sum(s.pauses for s in stats),
        "replays": sum(s.replays for s in stats), "replayed_tokens": replayed,
        "replay_share": replayed / (prompt_tokens + replayed + output_tokens),
        "approx_tokens": sum(s.approx_tokens for s in stats),
        "tier_loaded_tokens": sum(s.tier_loaded_tokens for s in stats),
        "need_fires": engine.counters.need_fires, "need_checks": engine.counters.need_checks,
        "peak_pool_bytes": engine.kv.peak_used_blocks * engine.kv.block_bytes,
        "peak_index_bytes": engine.kv.peak_index_bytes,
        "tokens": {i: outputs[i].token_ids for i in ids},
    }
    del llm, engine
    gc.collect()
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--full-holds", type=float, default=4.5,
                        help="the budget in long requests' full KV (default: %(default)s)")
    parser.add_argument("--policies", default="full,replay")
    parser.add_argument("--window-tokens", type=int, default=256)
    parser.add_argument("--trim", default="prefill")
    parser.add_argument("--replay-threshold", type=float, default=0.8)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--need-layers", default=None, help="e.g. 20-23 (default: all layers)")
    parser.add_argument("--heavy-tokens", type=int, default=0,
                        help="middle tokens with the most observed attention kept hot (default: 0)")
    parser.add_argument("--resident-ratio", type=float, default=None,
                        help="cap each decoding sequence's resident KV at this share of full's")
    parser.add_argument("--layered-prefill", action=argparse.BooleanOptionalAction, default=False,
                        help="compute a prompt whose middle is dropped after prefill one layer at a "
                             "time, for every policy without a variant (default: off, the engine's "
                             "default); 'replay/layered' or 'replay/chunked' in --policies sets it "
                             "for one run")
    parser.add_argument("--tier-memory", default="2GiB", help="session tier memory of POLICY/tier runs")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--watermarks", default=None,
                        help="low,admit,high for every policy of the run (default: the engine's)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: $KVREPLAY_DEVICE, else cpu)")
    parser.add_argument("--json")
    parser.add_argument("--timeline", help="write one JSON line per engine step here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from kvreplay.bench.workload import corpus_token_ids
    from kvreplay.models.loader import default_model_path, load_tokenizer
    from kvreplay.models.config import ModelConfig  # noqa: F401  (documents where sizes come from)
    tokenizer = load_tokenizer(default_model_path())
    corpus = corpus_token_ids(tokenizer)
    step = (len(corpus) - args.prompt_tokens) // args.requests
    prompts = [corpus[i * step:i * step + args.prompt_tokens] for i in range(args.requests)]
    runs = []
    timeline = open(args.timeline, "w") if args.timeline else None
    bytes_per_token = None
    for policy in args.policies.split(","):
        if bytes_per_token is None:
            from kvreplay import LLM
            probe = LLM(dtype=args.dtype, device=args.device, kv_cache_memory="16MiB")
            bytes_per_token = probe.engine.kv_bytes_per_token
            del probe
        budget = int(args.full_holds * (args.prompt_tokens + args.output_tokens) * bytes_per_token)
        print(f"{policy}: budget {budget / 2**20:.1f} MiB ({args.full_holds} long requests of full KV)", flush=True)
        runs.append(run_policy(policy, budget, prompts, args, timeline))
    if timeline is not None:
        timeline.close()
    reference = runs[0]["tokens"]
    for run in runs:
        same = [run["tokens"][k] == reference[k] for k in reference]
        prefix = []
        for k in reference:
            a, b = run["tokens"][k], reference[k]
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            prefix.append(n)
        run["exact_vs_first"] = sum(same) / len(same)
        run["matching_prefix_vs_first"] = sum(prefix) / len(prefix)
    header = ("policy", "decode tok/s", "output tok/s", "wall s", "TTFT mean/p50/max s", "mean batch",
              "peak running", "pauses",
              "replays", "replayed tok", "tier loaded tok", "replay share", "approx tok", "exact vs first",
              "match prefix")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in runs:
        print(f"| {r['policy']} | {r['decode_tok_s']:.1f} | {r['output_tok_s']:.1f} | {r['wall_s']:.1f} | "
              f"{r['ttft_mean_s']:.1f} / {r['ttft_p50_s']:.1f} / {r['ttft_max_s']:.1f} | {r['mean_decode_batch']:.1f} | {r['peak_running']} | {r['pauses']} | {r['replays']} | "
              f"{r['replayed_tokens']} | {r['tier_loaded_tokens']} | {r['replay_share']:.3f} | {r['approx_tokens']} | "
              f"{r['exact_vs_first']:.2f} | {r['matching_prefix_vs_first']:.1f} |")
    print()
    print("decode-only steps by phase: while requests wait (at capacity) | once none waits (drain)")
    print("| policy | waiting: decode tok/s | mean batch | steps | drain: decode tok/s | mean batch | steps |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in runs:
        print(f"| {r['policy']} | {fmt(r['waiting_decode_tok_s'])} | {r['waiting_mean_batch']:.1f} | "
              f"{r['waiting_steps']} | {fmt(r['drain_decode_tok_s'])} | {r['drain_mean_batch']:.1f} | "
              f"{r['drain_steps']} |")
    base = runs[0]
    for r in runs[1:]:
        print(f"{r['policy']} / {base['policy']}: decode tok/s x{r['decode_tok_s'] / base['decode_tok_s']:.2f}, "
              f"output tok/s x{r['output_tok_s'] / base['output_tok_s']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs]},
                      f, indent=1)


if __name__ == "__main__":
    main()

"""Where one decode step's time goes: the torch profiler over a few steps at a given batch.

With `--policy replay` (and the trimming options of bench/replay_serving.py) the prompts are
real text and the sequences are trimmed before the timed steps, as in that bench's decode phase.

Usage: python bench/profile_decode.py [--batch 32] [--threads 1] [--prompt-tokens 128] [--steps 5]
           [--policy replay --resident-ratio 0.2 --heavy-tokens 32 --need-layers 20-23]
           [--python [--sort cumulative]]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--policy", default="full")
    parser.add_argument("--resident-ratio", type=float, default=None)
    parser.add_argument("--heavy-tokens", type=int, default=0)
    parser.add_argument("--need-layers", default=None)
    parser.add_argument("--replay-threshold", type=float, default=0.65)
    parser.add_argument("--window-tokens", type=int, default=256, help="as bench/replay_serving.py")
    parser.add_argument("--layered-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="as bench/replay_serving.py")
    parser.add_argument("--sort", default="self_cpu_time_total",
                        help="order of the torch profiler's table; with --python: tottime or cumulative")
    parser.add_argument("--python", action="store_true",
                        help="cProfile the steps instead (where the Python time goes)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from torch.profiler import profile

    from kvreplay import LLM, SamplingParams
    dropping = args.policy != "full"
    options = dict(policy=args.policy, trim="prefill", resident_ratio=args.resident_ratio,
                   heavy_tokens=args.heavy_tokens, need_layers=args.need_layers,
                   replay_threshold=args.replay_threshold, window_tokens=args.window_tokens,
                   layered_prefill=args.layered_prefill) if dropping else {}
    llm = LLM(dtype=args.dtype, kv_cache_memory="1GiB", max_num_batched_tokens=8192,
              enable_prefix_caching=False, **options)
    engine = llm.engine
    params = SamplingParams(max_tokens=3 * args.steps + 8, ignore_eos=True, temperature=0)
    if dropping:  # real text: the need detector and importance see what the serving bench sees
        from kvreplay.bench.workload import corpus_token_ids
        corpus = corpus_token_ids(engine.tokenizer)
        stride = (len(corpus) - args.prompt_tokens) // args.batch
        prompts = [corpus[i * stride:i * stride + args.prompt_tokens] for i in range(args.batch)]
    else:
        prompts = [[1 + i] * args.prompt_tokens for i in range(args.batch)]
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(seq.num_uncomputed_tokens > 1 for seq in engine.scheduler.running) or engine.num_waiting:
        engine.step()  # prefill
    for _ in range(3):  # warm decode steps (a trim or a replay may land here)
        engine.step()
    print(f"resident tokens per sequence: {engine.kv.num_used_blocks * engine.kv.block_size / args.batch:.0f}")
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    if args.python:
        import cProfile
        import pstats
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            engine.step()
        profiler.disable()
        print(f"batch {args.batch}: {step_ms:.1f} ms per decode step ({args.batch / step_ms * 1e3:.0f} tok/s)")
        pstats.Stats(profiler).sort_stats(args.sort if args.sort in ("tottime", "cumulative") else "tottime").print_stats(40)
        return 0
    with profile(record_shapes=True) as prof:
        for _ in range(args.steps):
            engine.step()
    print(f"batch {args.batch}, {torch.get_num_threads()} threads: {step_ms:.1f} ms per decode step "
          f"({args.batch / step_ms * 1e3:.0f} tok/s)")
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by=args.sort, row_limit=20, max_name_column_width=28, max_shapes_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())

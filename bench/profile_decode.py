"""Where one decode step's time goes: the torch profiler over a few steps at a given batch.

Usage: python bench/profile_decode.py [--batch 32] [--threads 1] [--prompt-tokens 128] [--steps 5]
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
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from torch.profiler import profile

    from kvreplay import LLM, SamplingParams
    llm = LLM(dtype=args.dtype, kv_cache_memory="256MiB", max_num_batched_tokens=8192,
              enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=3 * args.steps + 4, ignore_eos=True, temperature=0)
    for i in range(args.batch):
        engine.add_request([1 + i] * args.prompt_tokens, params)
    for _ in range(3):  # the prefill step, then warm decode steps
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    with profile(record_shapes=True) as prof:
        for _ in range(args.steps):
            engine.step()
    print(f"batch {args.batch}, {torch.get_num_threads()} threads: {step_ms:.1f} ms per decode step "
          f"({args.batch / step_ms * 1e3:.0f} tok/s)")
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=28, max_shapes_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode-step time of one batch at several thread counts, side by side in one process: how far
a step is from scaling with the cores, and the serial share that implies.

Usage: python bench/decode_steps.py [--batch 32] [--prompt-tokens 128] [--decode-tokens 64]
           [--rounds 5] [--threads 1,2]

One engine on the embedded default model (bf16, no prefix caching); each round sends the batch
(prompts cut from the same text as `kvreplay bench throughput`), runs it to the end and times
its decode-only steps (every step after the last prompt chunk), once per thread count in turn.
Prints the median step per thread count and, against the first count, the speedup and the
serial share s of T(n) = T(1) (s + (1 - s) / n). Run it under PYTHONPATH=<another checkout> to
time another version of the engine the same way.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from kvreplay.bench.throughput import _positive, _prompts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alternating import bf16_engine  # noqa: E402


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated thread counts, got {text!r}")
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"thread counts must be positive, got {text!r}")
    return counts


def decode_step_ms(engine, prompts, decode_tokens: int) -> float:
    """Median time of the round's decode-only steps (no sequence still has prompt left)."""
    from kvreplay import SamplingParams
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    times = []
    while engine.has_unfinished_requests():
        decoding = not engine.num_waiting and all(
            seq.num_uncomputed_tokens <= 1 for seq in engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
    if not times:
        raise RuntimeError("no decode-only step: raise --decode-tokens")
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=_positive, default=32)
    parser.add_argument("--prompt-tokens", type=_positive, default=128)
    parser.add_argument("--decode-tokens", type=_positive, default=64)
    parser.add_argument("--rounds", type=_positive, default=5)
    parser.add_argument("--threads", type=_counts, default=[1, 2], help="comma-separated (default: 1,2)")
    args = parser.parse_args(argv)
    import torch

    llm = bf16_engine()
    prompts = _prompts(llm.engine.tokenizer, args.batch, args.prompt_tokens)
    decode_step_ms(llm.engine, prompts, 2)  # warm-up
    steps: dict[int, list[float]] = {n: [] for n in args.threads}
    for _ in range(args.rounds):
        for n in args.threads:
            torch.set_num_threads(n)
            steps[n].append(decode_step_ms(llm.engine, prompts, args.decode_tokens))
    first = args.threads[0]
    base = statistics.median(steps[first])
    print(f"batch {args.batch}, prompt {args.prompt_tokens} tokens, {args.decode_tokens} decode tokens, "
          f"median of {args.rounds} rounds")
    print("| threads | decode step ms | tok/s | speedup | serial share |")
    print("|---|---|---|---|---|")
    for n in args.threads:
        median = statistics.median(steps[n])
        speedup = base / median
        # T(n) / T(first) = s + (1 - s) * first / n, solved for s
        share = "" if n == first else f"{(median / base - first / n) / (1 - first / n):.2f}"
        print(f"| {n} | {median:.2f} | {args.batch / median * 1e3:.0f} | {speedup:.2f}x | {share} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

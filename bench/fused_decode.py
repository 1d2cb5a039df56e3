"""Decode throughput with and without decode_layer (one compiled call per decoder layer), side by
side in one process.

Usage: python bench/fused_decode.py [--batches 1,8,32] [--prompt-tokens 128] [--decode-tokens 32]
           [--rounds 4] [--threads 2]

For each batch: one engine, one untimed warm-up, then --rounds rounds that each time a full
generation (as bench/engine_throughput.py clocks kvreplay: prefill, then decode tokens/s) with the
fused layers and then without them (`LlamaModel.fused_rows` set to 0, which is what
KVREPLAY_FUSED_DECODE=0 does at load). Alternating in one process keeps the machine's drift out of
the ratio; separate processes minutes apart differ by more than the effect on a shared machine.
Prints the medians and their ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_throughput import _prompts, run_kvreplay  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.decode_tokens < 1:
        parser.error("--rounds and --decode-tokens must be at least 1")
    torch.set_num_threads(args.threads)
    from kvreplay import LLM
    llm = LLM(dtype="bfloat16", kv_cache_memory="512MiB", max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    model = llm.engine.runner.model
    fused = list(model.fused_rows)
    if not any(fused):
        print("decode_layer does not apply here (no layer ops, no panel kernel, or KVREPLAY_FUSED_DECODE=0)")
        return 1
    print("| batch | fused decode tok/s | layer code decode tok/s | ratio |")
    print("|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = _prompts(llm.tokenizer, batch, args.prompt_tokens)
        run_kvreplay(llm, prompts, 2)  # warm-up
        rates = {"fused": [], "python": []}
        for _ in range(args.rounds):
            for mode in rates:
                model.fused_rows = fused if mode == "fused" else [0] * len(fused)
                rates[mode].append(run_kvreplay(llm, prompts, args.decode_tokens)[1])
        model.fused_rows = fused
        a, b = statistics.median(rates["fused"]), statistics.median(rates["python"])
        print(f"| {batch} | {a:.1f} | {b:.1f} | {a / b:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

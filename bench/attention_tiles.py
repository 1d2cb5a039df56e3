"""Decode attention on AMX tiles against the vector kernel, side by side: the compiled kernel
alone over a step's layers of paged bf16 K/V, one pass with the tiles and one without
(KVREPLAY_AMX_ATTENTION, which the kernel reads at each call) in turn, in one process.

Usage: python bench/attention_tiles.py [--batch 32] [--context 144] [--layers 30] [--rounds 7]
           [--threads 2] [--placements resident,compact,scattered]

The shapes are the default model's (3 KV heads of 64, 9 query heads, 16-token blocks). Where
each row's blocks lie:
  resident   every row reads the same blocks: they stay in cache (the kernel's arithmetic alone)
  compact    each row's blocks one after another, the pool just big enough (as a fresh engine
             hands them out)
  scattered  each row's blocks anywhere in a pool of the size a 1 GiB budget gives
Prints, per placement, the median time of one pass over the layers with each kernel and their
ratio. Needs the compiled kernel; on a CPU without AMX tiles both passes run the vector code
(the table says so).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from kvreplay.bench.throughput import _positive

PLACEMENTS = ("resident", "compact", "scattered")


def _placements(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    bad = [name for name in names if name not in PLACEMENTS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"placements are {', '.join(PLACEMENTS)}; got {text!r}")
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=_positive, default=32)
    parser.add_argument("--context", type=_positive, default=144, help="tokens each row attends to")
    parser.add_argument("--layers", type=_positive, default=30)
    parser.add_argument("--rounds", type=_positive, default=7)
    parser.add_argument("--threads", type=_positive, default=2)
    parser.add_argument("--placements", type=_placements, default=list(PLACEMENTS))
    return parser


def run(args) -> int:
    import torch

    from kvreplay.kernels import cpu_kernels
    torch.set_num_threads(args.threads)
    op = cpu_kernels.decode_attention()
    if op is None:
        print("the compiled decode attention kernel is not available here", file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    num_kv, group, head_dim, block_size = 3, 3, 64, 16
    blocks = -(-args.context // block_size)
    query = torch.randn(args.batch, num_kv * group, head_dim, generator=gen).bfloat16()
    context = torch.full((args.batch,), args.context, dtype=torch.long)
    budget_blocks = (1 << 30) // (args.layers * 2 * num_kv * block_size * head_dim * 2)
    cases = {}
    for name in args.placements:
        if name == "resident":
            size, tables = blocks, torch.arange(blocks).repeat(args.batch, 1)
        elif name == "compact":
            size = args.batch * blocks
            tables = torch.arange(size).view(args.batch, blocks)
        else:
            size = max(args.batch * blocks, budget_blocks)
            tables = torch.randperm(size, generator=gen)[:args.batch * blocks].view(args.batch, blocks)
        caches = [torch.randn(2, num_kv, size, block_size, head_dim, generator=gen).bfloat16()
                  for _ in range(args.layers)]
        cases[name] = (tables, caches)

    def one_pass(name: str, tiles: bool) -> float:
        os.environ["KVREPLAY_AMX_ATTENTION"] = "1" if tiles else "0"
        tables, caches = cases[name]
        start = time.perf_counter()
        for cache in caches:
            op(query, cache[0], cache[1], tables, context, head_dim ** -0.5, False, False)
        return (time.perf_counter() - start) * 1e3

    previous = os.environ.get("KVREPLAY_AMX_ATTENTION")
    try:
        os.environ["KVREPLAY_AMX_ATTENTION"] = "1"
        on_tiles = torch.ops.kvreplay_cpu.has_amx_attention()
        for name in args.placements:  # warm up
            one_pass(name, True), one_pass(name, False)
        times = {(tiles, name): [] for tiles in (True, False) for name in args.placements}
        for round_ in range(args.rounds):
            for name in args.placements:
                for tiles in ((True, False) if round_ % 2 == 0 else (False, True)):
                    times[tiles, name].append(one_pass(name, tiles))
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        if previous is None:
            os.environ.pop("KVREPLAY_AMX_ATTENTION", None)
        else:
            os.environ["KVREPLAY_AMX_ATTENTION"] = previous
    note = "" if on_tiles else " (no AMX tiles here: both passes ran the vector kernel)"
    print(f"\nbatch {args.batch}, context {args.context}, {args.layers} layers, {args.threads} threads, "
          f"median of {args.rounds} passes each{note}\n")
    print("| placement | tiles, ms | vector, ms | ratio |")
    print("|---|---|---|---|")
    for name in args.placements:
        tiles, vector = (statistics.median(times[flag, name]) for flag in (True, False))
        print(f"| {name} | {tiles:.2f} | {vector:.2f} | {vector / tiles:.2f}x |")
    return 0


def main(argv=None) -> int:
    return run(_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

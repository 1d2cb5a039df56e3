"""Decode attention on AMX tiles against the vector kernel, side by side: the compiled kernel
alone over a step's layers of paged bf16 K/V, in two worker processes (KVREPLAY_AMX_ATTENTION=1
and 0: the switch is read once per process) that take turns, one timed pass each per round.

Usage: python bench/attention_tiles.py [--batch 32] [--context 144] [--layers 30] [--rounds 7]
           [--threads 2] [--placements resident,compact,scattered]

The shapes are the default model's (3 KV heads of 64, 9 query heads, 16-token blocks). Where
each row's blocks lie:
  resident   every row reads the same blocks: they stay in cache (the kernel's arithmetic alone)
  compact    each row's blocks one after another, the pool just big enough (as a fresh engine
             hands them out)
  scattered  each row's blocks anywhere in a pool of the size a 1 GiB budget gives
Prints, per placement, the median time of one pass over the layers with each kernel and their
ratio. Needs the compiled kernel; on a CPU without AMX tiles both workers run the vector code
(the table says so).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
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
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def worker(args) -> int:
    """Builds every placement's caches, then times one pass per `run <placement>` line on stdin."""
    import torch

    from kvreplay.engine import cpu_kernels
    torch.set_num_threads(args.threads)
    op = cpu_kernels.decode_attention()
    if op is None:
        print("error: the compiled decode attention kernel is not available here", flush=True)
        return 1
    gen = torch.Generator().manual_seed(0)
    num_kv, group, head_dim, block_size = 3, 3, 64, 16
    blocks = -(-args.context // block_size)
    query = torch.randn(args.batch, num_kv * group, head_dim, generator=gen).bfloat16()
    context = torch.full((args.batch,), args.context, dtype=torch.long)
    pool_blocks = {"resident": blocks, "compact": args.batch * blocks,
                   "scattered": max(args.batch * blocks, (1 << 30) // (args.layers * 2 * num_kv * block_size
                                                                       * head_dim * 2))}
    cases = {}
    for name in args.placements:
        size = pool_blocks[name]
        if name == "resident":
            tables = torch.arange(blocks).repeat(args.batch, 1)
        elif name == "compact":
            tables = torch.arange(args.batch * blocks).view(args.batch, blocks)
        else:
            tables = torch.randperm(size, generator=gen)[:args.batch * blocks].view(args.batch, blocks)
        caches = [torch.randn(2, num_kv, size, block_size, head_dim, generator=gen).bfloat16()
                  for _ in range(args.layers)]
        cases[name] = (tables, caches)
    tiles = torch.ops.kvreplay_cpu.has_amx_attention()

    def one_pass(name: str) -> float:
        tables, caches = cases[name]
        start = time.perf_counter()
        for cache in caches:
            op(query, cache[0], cache[1], tables, context, head_dim ** -0.5, False, False)
        return (time.perf_counter() - start) * 1e3

    for name in args.placements:  # warm up
        one_pass(name)
    print(f"ready tiles={int(tiles)}", flush=True)
    for line in sys.stdin:
        name = line.split()[1]
        print(f"{one_pass(name):.4f}", flush=True)
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return worker(args)
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--batch", str(args.batch), "--context",
               str(args.context), "--layers", str(args.layers), "--threads", str(args.threads),
               "--placements", ",".join(args.placements)]
    workers, on_tiles = {}, {}
    for label, switch in (("tiles", "1"), ("vector", "0")):
        env = {**os.environ, "KVREPLAY_AMX_ATTENTION": switch}
        workers[label] = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                          env=env)
    try:
        for label, process in workers.items():
            ready = process.stdout.readline().strip()
            if not ready.startswith("ready"):
                print(f"the {label} worker failed: {ready or 'no output'}", file=sys.stderr)
                return 1
            on_tiles[label] = ready.endswith("tiles=1")
        times = {(label, name): [] for label in workers for name in args.placements}
        for round_ in range(args.rounds):
            for name in args.placements:
                for label, process in workers.items():
                    process.stdin.write(f"run {name}\n")
                    process.stdin.flush()
                    times[label, name].append(float(process.stdout.readline()))
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for process in workers.values():
            if process.stdin:
                process.stdin.close()
            process.wait(timeout=60)
    note = "" if on_tiles["tiles"] else " (no AMX tiles here: both workers ran the vector kernel)"
    print(f"\nbatch {args.batch}, context {args.context}, {args.layers} layers, {args.threads} threads, "
          f"median of {args.rounds} passes each{note}\n")
    print("| placement | tiles, ms | vector, ms | ratio |")
    print("|---|---|---|---|")
    for name in args.placements:
        tiles, vector = (statistics.median(times[label, name]) for label in ("tiles", "vector"))
        print(f"| {name} | {tiles:.2f} | {vector:.2f} | {vector / tiles:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What this machine can do at best, to put the engine's figures in proportion.

Usage: python bench/machine_limits.py [--threads N] [--dtype bfloat16]

Measures memory bandwidth (a large tensor copy: read + write; a large sum: read only, which is
what streaming weights does) and the matmul rate at the shapes a decode step of the default model
uses, through plain `F.linear`, through the engine's `Projection` (packed oneDNN weights, the
panel kernel up to `machine_panel_rows()` rows: 128 on an AVX512-BF16 CPU, 64 with AMX tiles),
and through `Projection` with quantized panels (bf16 panels kept as the GGUF's blocks: Q4_1
projections and a Q8_0 LM head, the default model's formats; random blocks here), then prints
the floor on one decode step: max(weight bytes / read bandwidth, FLOPs / matmul rate) at batch
1, 4, 8, 16, 32, 64 and 256, for bf16 weights and for the blocks.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch


def median_seconds(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    from kvreplay.models.loader import read_model_config
    cfg = read_model_config(None)
    src = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB
    dst = torch.empty_like(src)
    copy_s = median_seconds(lambda: dst.copy_(src))
    bandwidth = 2 * src.numel() * 4 / copy_s  # bytes read + written per second
    read = torch.ones(256 * 2**20, dtype=torch.bfloat16)  # 512 MiB, larger than any cache
    read_bandwidth = read.numel() * 2 / median_seconds(lambda: read.sum())

    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = [(qkv, hidden), (hidden, cfg.num_heads * cfg.head_dim), (2 * inter, hidden), (hidden, inter)]
    params_per_layer = sum(o * i for o, i in shapes)
    weight_params = cfg.num_layers * params_per_layer + cfg.vocab_size * hidden  # + lm_head
    weight_bytes = weight_params * torch.finfo(dtype).bits // 8

    print(f"torch threads {torch.get_num_threads()}, {args.dtype}")
    print(f"memory bandwidth (copy, read+write): {bandwidth / 1e9:.1f} GB/s; read only (sum): "
          f"{read_bandwidth / 1e9:.1f} GB/s")
    print(f"decode-step weights: {weight_params / 1e6:.1f} M parameters = {weight_bytes / 1e6:.0f} MB")
    # Every layer gets its own weights, as in the model: they stream from memory, not from cache.
    from kvreplay.layers.linear import Projection, QuantizedWeight
    # (weight, input width) in model order; the LM head last
    plain = [(torch.randn(o, i, dtype=dtype), i) for _ in range(cfg.num_layers) for o, i in shapes]
    plain.append((torch.randn(cfg.vocab_size, hidden, dtype=dtype), hidden))
    engine = [(Projection(w), i) for w, i in plain]
    matmuls = {"F.linear": (plain, lambda x, w: torch.nn.functional.linear(x, w)),
               "Projection": (engine, lambda x, proj: proj(x))}
    floor_bw = weight_bytes / read_bandwidth
    blocks = [(w, i, "Q8_0" if index == len(plain) - 1 else "Q4_1") for index, (w, i) in enumerate(plain)]
    os.environ["KVREPLAY_QUANT_PANELS"] = "1"  # the blocks even where the default is bf16 panels
    quantized = [(Projection(w, quantized=QuantizedWeight(fmt, random_blocks(fmt, *w.shape))), i)
                 for w, i, fmt in blocks]
    if dtype == torch.bfloat16 and all(p.panel_format != "bf16" for p, _ in quantized):
        block_bytes = sum(p.panels.numel() for p, _ in quantized)
        print(f"the same as blocks (Q4_1, LM head Q8_0): {block_bytes / 1e6:.0f} MB, read-bandwidth floor "
              f"{block_bytes / read_bandwidth * 1e3:.1f} ms a step")
        matmuls["Q4_1 panels"] = (quantized, lambda x, proj: proj(x))
    for batch in (1, 4, 8, 16, 32, 64, 256):
        x = {i: torch.randn(batch, i, dtype=dtype) for i in {hidden, inter}}
        for name, (weights, matmul) in matmuls.items():
            def step():
                for w, width in weights:
                    matmul(x[width], w)
            step_s = median_seconds(step, repeats=5)
            flops = 2 * batch * weight_params
            print(f"batch {batch:>3}, {name:<10}: matmuls of one decode step {step_s * 1e3:7.1f} ms "
                  f"({flops / step_s / 1e9:6.1f} GFLOP/s, weights at {weight_bytes / step_s / 1e9:4.1f} GB/s) "
                  f"-> at most {batch / step_s:7.0f} tok/s; read-bandwidth floor {floor_bw * 1e3:.1f} ms "
                  f"-> {batch / floor_bw:7.0f} tok/s")
    return 0


def random_blocks(fmt: str, n: int, k: int) -> torch.Tensor:
    """GGUF rows [n, k / 32 * block bytes] of random quants with small finite scales."""
    rng = np.random.default_rng(n * 7 + k)
    count = n * k // 32
    scales = [rng.uniform(1e-3, 1e-2, count).astype(np.float16)]
    if fmt == "Q4_1":
        scales.append((-8 * scales[0].astype(np.float32)).astype(np.float16))
    quants = rng.integers(0, 256, (count, 16 if fmt == "Q4_1" else 32), dtype=np.uint8)
    raw = np.concatenate([s.view(np.uint8).reshape(count, 2) for s in scales] + [quants], axis=1)
    return torch.from_numpy(np.ascontiguousarray(raw.reshape(n, -1)))


if __name__ == "__main__":
    sys.exit(main())

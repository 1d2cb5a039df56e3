"""Causal attention of one fresh bf16 prompt chunk: the compiled kernel against PyTorch's SDPA.

Shapes of the default model (9 query heads over 3 KV heads, head size 64) at several chunk
lengths; q, k and v are views into one fused QKV output, as the model hands them over. Reports the
median time of each and their error against exact fp32 attention on the same bf16 inputs.

Usage: python bench/prefill_attention.py [--tokens 128,512,2048] [--threads 2] [--repeats 30]
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from machine_limits import median_seconds  # a sibling script (bench/ is on the path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="128,512,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvreplay.kernels import cpu_kernels
    kernel = cpu_kernels.prefill_attention(only_where_faster=False)
    if kernel is None:
        print("no compiled prefill kernel here (no toolchain, KVREPLAY_CPU_KERNELS=0 or no AVX512-BF16)")
        return 1
    num_q, num_kv, head_dim, scale = 9, 3, 64, 0.125
    print("| tokens | kernel us | SDPA us | speedup | kernel max error | SDPA max error |")
    print("|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        fused = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim).bfloat16()
        q = fused[:, :num_q * head_dim].view(tokens, num_q, head_dim)
        k = fused[:, num_q * head_dim:(num_q + num_kv) * head_dim].view(tokens, num_kv, head_dim)
        v = fused[:, (num_q + num_kv) * head_dim:].view(tokens, num_kv, head_dim)

        def sdpa():
            return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                  v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                                  enable_gqa=True)[0].transpose(0, 1)
        group = num_q // num_kv
        scores = q.float().transpose(0, 1) @ k.float().transpose(0, 1).repeat_interleave(group, 0).transpose(1, 2)
        scores = (scores * scale).masked_fill(~torch.ones(tokens, tokens, dtype=torch.bool).tril(), float("-inf"))
        exact = (torch.softmax(scores, -1) @ v.float().transpose(0, 1).repeat_interleave(group, 0)).transpose(0, 1)
        ours_us = median_seconds(lambda: kernel(q, k, v, scale), args.repeats) * 1e6
        sdpa_us = median_seconds(sdpa, args.repeats) * 1e6
        ours_err = (kernel(q, k, v, scale).float() - exact).abs().max().item()
        sdpa_err = (sdpa().float() - exact).abs().max().item()
        print(f"| {tokens} | {ours_us:.0f} | {sdpa_us:.0f} | {sdpa_us / ours_us:.2f}x | {ours_err:.4f} | {sdpa_err:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

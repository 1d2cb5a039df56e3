"""oneDNN sees a few row counts (kvreplay/layers/linear.py `onednn_rows`): it keeps native memory
for each one it has multiplied, so a server whose prefill steps came in any row count grew its
resident memory with each new one (the soak, docs/benchmarks.md). Padding keeps F.linear's bits."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvreplay.layers.linear import ONEDNN_SIZES_PER_OCTAVE, Projection, can_pack, onednn_rows


def test_row_counts_round_up_to_a_few_sizes_an_octave():
    assert [onednn_rows(rows) for rows in range(1, 17)] == list(range(1, 17))
    assert onednn_rows(129) == 144 and onednn_rows(144) == 144 and onednn_rows(257) == 288
    for rows in range(1, 9000):
        assert rows <= onednn_rows(rows) <= rows * 9 / 8
        assert onednn_rows(onednn_rows(rows)) == onednn_rows(rows)
    assert len({onednn_rows(rows) for rows in range(129, 513)}) == 16
    for low in (256, 1024, 4096):  # a doubling adds ONEDNN_SIZES_PER_OCTAVE sizes, whatever its rows
        assert len({onednn_rows(rows) for rows in range(low + 1, 2 * low + 1)}) == ONEDNN_SIZES_PER_OCTAVE


@pytest.mark.parametrize("rows", [129, 200, 300, 511])
def test_padded_rows_give_plain_linears_bits(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 41, generator=gen).bfloat16()  # an odd width: no panel kernel
    bias = torch.randn(96, generator=gen).bfloat16()
    if not can_pack(weight):
        pytest.skip("oneDNN takes no bf16 products here (no oneDNN, or an AVX2-only CPU)")
    x = torch.randn(rows, 41, generator=gen).bfloat16()
    got = Projection(weight, bias)(x)
    assert got.shape == (rows, 96) and got.is_contiguous()
    assert torch.equal(got, F.linear(x, weight, bias))


_GROWTH = """
import re, sys, torch
from kvreplay.layers.linear import Projection, can_pack
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) / 1024
weight = torch.randn(1536, 576).bfloat16()
if not can_pack(weight):
    sys.exit(3)
proj = Projection(weight, panel_rows=0)
x = torch.randn(512, 576).bfloat16()
proj(x[:129])
start = rss()
for rows in range(129, 513):
    proj(x[:rows])
print(rss() - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_projection_over_every_row_count_keeps_its_resident_memory():
    """A fresh process multiplies one SmolLM2-sized weight at each of 129 to 512 rows: before the
    padding its resident memory grew ~380 MiB (here, AVX-512 EPYC), now ~20 MiB."""
    env = {**os.environ, "KVREPLAY_CPU_KERNELS": "0"}  # oneDNN only: nothing to build
    result = subprocess.run([sys.executable, "-c", _GROWTH], env=env, capture_output=True, text=True, timeout=120)
    if result.returncode == 3:
        pytest.skip("oneDNN takes no bf16 products here")
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.split()[-1]) < 96, result.stdout

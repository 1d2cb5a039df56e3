"""oneDNN sees a few sizes (kvreplay/layers/linear.py `onednn_rows`): it keeps native memory for
each shape it has multiplied, so a server whose prefill steps came in any row count, and whose
prompts' observation scores came in any length, grew its resident memory with each new one (the
soak, docs/benchmarks.md). Padding keeps the unpadded products' bits."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvreplay.layers.attention import _scores
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


@pytest.mark.parametrize("rows", [12, 96])
@pytest.mark.parametrize("context", [17, 342, 1536, 2651])
def test_padded_scores_give_bmms_bits(rows, context):
    gen = torch.Generator().manual_seed(rows * context)
    query = torch.randn(3, rows, 64, generator=gen).bfloat16()
    keys = torch.randn(3, context, 64, generator=gen).bfloat16()
    for got in (_scores(query, keys), _scores(query, keys, rows_at_least=96)):
        assert got.shape == (3, rows, context) and got.float().is_contiguous()
        assert torch.equal(got, torch.bmm(query, keys.transpose(1, 2)))
    query, keys = query.float(), keys.float()  # fp32: not padded
    assert torch.equal(_scores(query, keys), torch.bmm(query, keys.transpose(1, 2)))


_GROWTH = """
import re, sys, torch
from kvreplay.layers.attention import _scores
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
grown = rss() - start
query, keys = torch.randn(3, 96, 64).bfloat16(), torch.randn(3, 4096, 64).bfloat16()
_scores(query, keys[:, :100])
start = rss()
for context in range(100, 4096, 16):
    _scores(query, keys[:, :context])
print(grown, rss() - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_products_over_every_row_count_and_length_keep_their_resident_memory():
    """A fresh process multiplies one SmolLM2-sized weight at each of 129 to 512 rows, then scores
    32 queries (3 KV heads) against 250 key lengths from 100 to 4,096: before the padding its
    resident memory grew ~380 MiB and ~170 MiB (here, AVX-512 EPYC), now ~20 MiB each."""
    env = {**os.environ, "KVREPLAY_CPU_KERNELS": "0"}  # oneDNN only: nothing to build
    result = subprocess.run([sys.executable, "-c", _GROWTH], env=env, capture_output=True, text=True, timeout=120)
    if result.returncode == 3:
        pytest.skip("oneDNN takes no bf16 products here")
    assert result.returncode == 0, result.stderr[-2000:]
    projections, scores = map(float, result.stdout.split()[-2:])
    assert projections < 96 and scores < 96, result.stdout

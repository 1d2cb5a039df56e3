"""The Triton kernels (kvreplay/kernels/triton_*.py) against the PyTorch code the engine runs today.

Without a GPU they run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, set here
before triton is imported); on a CUDA machine (bench/gpu_check.sh) the same tests run compiled on
the GPU unless TRITON_INTERPRET=1 is set. Small shapes: rows of different lengths, lengths that are
not a whole number of blocks, scrambled block tables, GQA groups of 1, 3 and 4.
"""
import os

import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's setup installs it)")

from kvreplay.kernels.triton_backend import kernels  # noqa: E402
from kvreplay.layers.attention import AttentionMetadata, NeedProbe, _decode_attention, decode_padding  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
OPS = kernels()
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _paged_cache(num_kv, num_blocks, block_size, head_dim, dtype, seed=0):
    """A layer's cache [Hkv, num_blocks, bs, D] for keys and for values, random everywhere (so a
    kernel reading a wrong block or a row past the context shows)."""
    gen = _gen(seed)
    keys = torch.randn(num_kv, num_blocks, block_size, head_dim, generator=gen)
    values = torch.randn(num_kv, num_blocks, block_size, head_dim, generator=gen)
    return keys.to(DEVICE, dtype), values.to(DEVICE, dtype)


def _tables(lengths, block_size, num_blocks, seed=0):
    """Scrambled block tables [B, W] for rows of `lengths` tokens, padded with block 0."""
    width = max(-(-n // block_size) for n in lengths)
    order = torch.randperm(num_blocks, generator=_gen(seed + 1))
    tables, used = torch.zeros(len(lengths), width, dtype=torch.long), 0
    for row, n in enumerate(lengths):
        blocks = -(-n // block_size)
        tables[row, :blocks] = order[used:used + blocks]
        used += blocks
    return tables.to(DEVICE), torch.tensor(lengths, device=DEVICE)


class _RecordingIndex:
    """Stands in for the key index: keeps the lse the attention hands the need probe."""
    def __init__(self):
        self.lse = None

    def max_block_mass(self, layer, query, slot_table, valid, lse, top_blocks):
        self.lse = lse
        rows = query.shape[0]
        return torch.zeros(rows, device=query.device), torch.zeros(rows, dtype=torch.long, device=query.device)


def _decode_meta(tables, lengths, num_kv, block_size, kernel, probed: bool):
    meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decode_tokens=len(lengths),
                             decode_block_tables=tables, decode_context=lengths, observe_decode=True)
    if kernel is None:
        meta.decode_padding = decode_padding(lengths, tables.shape[1] * block_size, num_kv)
    else:
        meta.decode_kernel = kernel
    index = _RecordingIndex()
    if probed:
        rows = torch.arange(len(lengths), device=DEVICE)
        empty = torch.zeros(len(lengths), 1, dtype=torch.long, device=DEVICE)
        meta.probe = NeedProbe(rows, empty, empty.bool(), index, top_blocks=1)
    return meta, index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q,num_kv,head_dim,block_size,lengths", [
    (9, 3, 64, 16, [37, 5, 16, 64]),      # the default model's heads; tails, one block, whole blocks
    (4, 4, 32, 8, [1, 23]),                # no GQA (G = 1), a row of one token
    (8, 2, 16, 4, [9, 30, 17])])           # G = 4, tiny blocks
def test_decode_attention_matches_the_torch_path(dtype, num_q, num_kv, head_dim, block_size, lengths):
    """Output, the need probe's log-sum-exp and the importance block mass, as _decode_attention
    computes them on the PyTorch path (padded, masked, gathered) and through the kernel."""
    key_cache, value_cache = _paged_cache(num_kv, 24, block_size, head_dim, dtype)
    tables, context = _tables(lengths, block_size, 24)
    q = torch.randn(len(lengths), num_q, head_dim, generator=_gen(3)).to(DEVICE, dtype)
    scale = head_dim ** -0.5
    results = []
    for kernel in (None, OPS.decode_attention):
        meta, index = _decode_meta(tables, context, num_kv, block_size, kernel, probed=True)
        out = _decode_attention(q, key_cache, value_cache, meta, scale)
        results.append((out.float(), index.lse.float(), meta.decode_mass))
    (ref, ref_lse, ref_mass), (ours, lse, mass) = results
    tol = TOL[dtype]
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(mass, ref_mass, atol=tol, rtol=tol)
    assert mass.shape == (len(lengths), tables.shape[1])


def test_decode_attention_ignores_blocks_past_the_context():
    """Poisoning every cache row past each row's length changes nothing."""
    lengths = [13, 7]
    key_cache, value_cache = _paged_cache(2, 8, 8, 16, torch.float32)
    tables, context = _tables(lengths, 8, 8)
    q = torch.randn(2, 4, 16, generator=_gen(5)).to(DEVICE)
    before = OPS.decode_attention(q, key_cache, value_cache, tables, context, 0.25, True, True)
    for row, n in enumerate(lengths):
        for column in range(tables.shape[1]):
            live = max(0, min(8, n - column * 8))
            key_cache[:, tables[row, column], live:] = 1e4
            value_cache[:, tables[row, column], live:] = float("nan")
    after = OPS.decode_attention(q, key_cache, value_cache, tables, context, 0.25, True, True)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b)


def _prefill_reference(q, key_cache, value_cache, table, context, causal_from, scale):
    """The engine's path for a chunk over cached blocks: gather by the table, SDPA with its mask."""
    num_kv, _, _, head_dim = key_cache.shape
    keys = key_cache.index_select(1, table).view(num_kv, -1, head_dim)[:, :context]
    values = value_cache.index_select(1, table).view(num_kv, -1, head_dim)[:, :context]
    rows = q.shape[0]
    mask = torch.arange(context, device=q.device)[None, :] <= torch.arange(causal_from, causal_from + rows,
                                                                            device=q.device)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q,num_kv,head_dim,block_size,causal_from,rows", [
    (9, 3, 64, 16, 0, 21),     # a fresh prompt's first chunk, not a whole number of blocks
    (9, 3, 64, 16, 37, 19),    # a later chunk over 37 cached positions
    (4, 1, 32, 8, 5, 40),      # G = 4, more than two query tiles
    (2, 2, 16, 4, 50, 3)])     # no GQA, a short chunk at the end of a long context
def test_prefill_attention_matches_sdpa_over_gathered_blocks(dtype, num_q, num_kv, head_dim, block_size,
                                                             causal_from, rows):
    context = causal_from + rows
    blocks = -(-context // block_size)
    key_cache, value_cache = _paged_cache(num_kv, blocks + 6, block_size, head_dim, dtype, seed=7)
    table = torch.randperm(blocks + 6, generator=_gen(8))[:blocks].to(DEVICE)
    q = torch.randn(rows, num_q, head_dim, generator=_gen(9)).to(DEVICE, dtype)
    scale = head_dim ** -0.5
    ours = OPS.prefill_attention(q, key_cache, value_cache, table, context, causal_from, scale)
    ref = _prefill_reference(q.float(), key_cache.float(), value_cache.float(), table, context, causal_from,
                             scale)
    assert ours.dtype == dtype and ours.shape == q.shape
    torch.testing.assert_close(ours.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def _slot_table(rows, columns, pool_slots, seed):
    """[R, N] scrambled slots, each row's last columns padding (valid False) when it has fewer."""
    gen = _gen(seed)
    table = torch.stack([torch.randperm(pool_slots, generator=gen)[:columns] for _ in range(rows)])
    valid = torch.ones(rows, columns, dtype=torch.bool)
    for row in range(rows):
        valid[row, columns - row % 3:] = False  # rows of 0, 1 and 2 padded columns
    return table.to(DEVICE), valid.to(DEVICE)


@pytest.mark.parametrize("group,head_dim", [(3, 64), (1, 32), (4, 16)])
def test_quest_bound_matches_block_upper_bound(group, head_dim):
    """The kernel's bound through a slot table against kv/quant.py's block_upper_bound on the
    gathered summaries, as the cold tier's selection computes it."""
    from kvreplay.kv.quant import block_upper_bound
    rows, num_kv, columns, pool_slots = 4, 2, 11, 20
    gen = _gen(11)
    lo = torch.randn(num_kv, pool_slots, head_dim, generator=gen)
    hi = (lo + torch.rand(num_kv, pool_slots, head_dim, generator=gen) * 2).half().to(DEVICE)
    lo = lo.half().to(DEVICE)
    query = torch.randn(rows, num_kv, group, head_dim, generator=gen).to(DEVICE)
    table, valid = _slot_table(rows, columns, pool_slots, seed=12)
    ours = OPS.quest_bound(query, lo, hi, table, valid)
    gathered = lambda s: s[:, table].transpose(0, 1).float()  # noqa: E731 - [R, Hkv, N, D]
    ref = block_upper_bound(query, gathered(lo), gathered(hi)).amax(2)
    ref.masked_fill_(~valid[:, None, :], float("-inf"))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert torch.isinf(ours[~valid[:, None, :].expand_as(ours)]).all()


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("group", [3, 1])
def test_cold_attention_dequantizes_like_the_cold_pool(kind, group):
    """Attention within each head's picked cold blocks read straight from the pool's quantized
    fields, against ColdPool.gather (dequantized in torch) and a masked softmax."""
    from kvreplay.kv.cold_pool import ColdPool
    layers, num_kv, block_size, head_dim, rows, picks = 2, 2, 16, 64, 3, 4
    pool = ColdPool(layers, num_kv, block_size, head_dim, kind, device=DEVICE, initial_slots=4)
    gen = _gen(21)
    keys = torch.randn(layers, num_kv, 10, block_size, head_dim, generator=gen) \
        + torch.randn(head_dim, generator=gen)
    pool.add(keys.to(DEVICE), torch.randn(keys.shape, generator=gen).to(DEVICE))
    slots = torch.stack([torch.randperm(10, generator=gen)[:picks] for _ in range(rows * num_kv)]) \
        .view(rows, num_kv, picks).to(DEVICE)
    valid = torch.ones(rows, num_kv, picks, dtype=torch.bool, device=DEVICE)
    valid[1, 0, 2:] = False
    valid[2, 1, :] = False  # a head with nothing to read: zero output, lse -inf
    query = torch.randn(rows, num_kv, group, head_dim, generator=gen).to(DEVICE) * 0.2
    layer = 1
    ours, lse, block_lse = OPS.cold_attention(query, {name: t[layer] for name, t in pool.stored.items()}, kind,
                                              slots, valid)
    k, v = pool.gather(layer, slots, torch.float32)                   # [B, Hkv, k, bs, D]
    k, v = k.flatten(2, 3), v.flatten(2, 3)                            # [B, Hkv, k*bs, D]
    scores = (query @ k.transpose(-1, -2)).masked_fill(
        ~valid.repeat_interleave(block_size, -1)[:, :, None, :], float("-inf"))
    ref_lse = scores.logsumexp(-1)
    ref = torch.nan_to_num(torch.softmax(scores, -1)) @ v
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    ref_block_lse = scores.unflatten(-1, (picks, block_size)).logsumexp(-1)  # [B, Hkv, G, k]
    torch.testing.assert_close(block_lse, ref_block_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("group,top_blocks", [(3, 2), (4, 8)])
def test_need_block_mass_matches_the_key_index_torch_path(group, top_blocks):
    """KeyIndex.max_block_mass with the Triton bound and block scores against its PyTorch path:
    the same share and the same flagged block per row (some rows padded, top_blocks past N)."""
    from kvreplay.kv.key_index import KeyIndex
    num_kv, block_size, head_dim, rows = 2, 16, 64, 4
    index = KeyIndex(2, num_kv, block_size, head_dim, device=DEVICE)
    index.kernel = None  # the PyTorch path, not the compiled CPU detector
    gen = _gen(31)
    slots = index.add(torch.randn(2, num_kv, 12, block_size, head_dim, generator=gen).to(DEVICE))
    table, valid = _slot_table(rows, 7, len(slots), seed=32)
    query = torch.randn(rows, num_kv, group, head_dim, generator=gen).to(DEVICE) * 0.3
    resident = torch.randn(rows, num_kv, group, generator=gen).to(DEVICE) + 3
    ref = index.max_block_mass(1, query, table, valid, resident, top_blocks)
    index.triton = OPS
    ours = index.max_block_mass(1, query, table, valid, resident, top_blocks)
    torch.testing.assert_close(ours[0], ref[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(ours[1], ref[1])
    assert (ref[0] > 0.01).all()  # the figures compared are not vanishing ones


ENGINE_CASES = {  # policy -> knobs: which kernels a run reaches besides decode and prefill attention
    "full": {},
    "replay": {"trim": "prefill", "resident_ratio": 0.3, "need_layers": "all", "replay_threshold": 0.3,
               "heavy_tokens": 0},                                 # the need detector's bound and block scores
    "sparse": {"resident_ratio": 0.3, "sparse_budget": 32},       # the cold tier: bound, attention, mass
}


@pytest.mark.skipif(ON_GPU, reason="the GPU engine tests (bench/gpu_check.sh step 6) cover the GPU engine")
@pytest.mark.parametrize("policy", ENGINE_CASES)
def test_engine_generates_the_same_tokens_with_the_triton_backend(tiny_model, policy):
    """Greedy fp32 generations through the interpreted kernels give the torch backend's tokens
    (the 2-layer random Llama: prompts of 5 to 300 tokens, not whole blocks)."""
    from kvreplay import LLM, SamplingParams
    prompts = [torch.randint(100, 40000, (n,), generator=_gen(n)).tolist() for n in (5, 37, 300)]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    tokens, calls = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="4MiB", attention_backend=backend,
                  policy=policy, window_tokens=32, enable_prefix_caching=False, **ENGINE_CASES[policy])
        if backend == "triton":
            calls = _count_calls(llm.engine.runner.triton)
            llm.engine.runner.decode_kernel = llm.engine.runner.triton.decode_attention
        tokens[backend] = [out.token_ids for out in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
    reached = {name for name, count in calls.items() if count}
    assert reached >= {"full": {"decode_attention", "prefill_attention"},
                       "replay": {"decode_attention", "quest_bound", "need_block_lse"},
                       "sparse": {"decode_attention", "quest_bound", "cold_attention", "decode_block_mass"}}[policy]


def _count_calls(ops) -> dict:
    """Wrap each kernel of the namespace `ops` (in place) to count its calls into the dict returned."""
    calls = {}
    for name, fn in vars(ops).copy().items():
        calls[name] = 0

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        setattr(ops, name, counted)
    return calls


def test_cold_selection_through_the_kernel_picks_the_torch_paths_blocks():
    """The sparse path's choice of cold blocks (_cold_blocks) with the Triton Quest bound reads
    the same blocks per KV head as with block_upper_bound on the gathered summaries."""
    from kvreplay.kv.cold_pool import ColdPool
    from kvreplay.layers.attention import ColdAttention, _cold_blocks
    num_kv, group, block_size, head_dim, rows = 2, 3, 16, 64, 3
    pool = ColdPool(1, num_kv, block_size, head_dim, "int8", device=DEVICE, initial_slots=4)
    gen = _gen(41)
    keys = torch.randn(1, num_kv, 9, block_size, head_dim, generator=gen) + torch.randn(head_dim, generator=gen)
    pool.add(keys.to(DEVICE), torch.randn(keys.shape, generator=gen).to(DEVICE))
    table, valid = _slot_table(rows, 6, 9, seed=42)
    query = torch.randn(num_kv * rows, group, head_dim, generator=gen).to(DEVICE)  # [Hkv*B, G, D]
    results = []
    for ops in (None, OPS):
        cold = ColdAttention(table, valid, pool, budget_blocks=2, triton=ops)
        results.append(_cold_blocks(cold, query, num_kv, rows, group))
    (ref_k, ref_v, ref_valid, ref_top), (k, v, picked_valid, top) = results
    assert torch.equal(top, ref_top) and torch.equal(picked_valid, ref_valid)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("budget", [None, 2])
def test_decode_over_hot_and_cold_blocks_matches_the_torch_path(kind, budget):
    """_decode_attention with a cold tier: the Triton route (hot and cold attended apart, merged
    by log-sum-exp, cold blocks dequantized in the kernel) against the PyTorch route (one softmax
    over gathered hot keys and dequantized cold copies): output, the probe's lse, hot and cold
    block mass; every cold block (budget None) or each KV head's top 2 by Quest bound."""
    from kvreplay.kv.cold_pool import ColdPool
    from kvreplay.layers.attention import ColdAttention
    num_q, num_kv, head_dim, block_size, lengths = 6, 2, 64, 16, [37, 5, 20]
    key_cache, value_cache = _paged_cache(num_kv, 12, block_size, head_dim, torch.float32, seed=51)
    tables, context = _tables(lengths, block_size, 12, seed=52)
    pool = ColdPool(1, num_kv, block_size, head_dim, kind, device=DEVICE, initial_slots=4)
    gen = _gen(53)
    cold_keys = torch.randn(1, num_kv, 8, block_size, head_dim, generator=gen) + torch.randn(head_dim, generator=gen)
    pool.add(cold_keys.to(DEVICE), torch.randn(cold_keys.shape, generator=gen).to(DEVICE))
    slot_table, slot_valid = _slot_table(len(lengths), 5, 8, seed=54)
    q = torch.randn(len(lengths), num_q, head_dim, generator=gen).to(DEVICE)
    results = []
    for ops in (None, OPS):
        meta, index = _decode_meta(tables, context, num_kv, block_size, None, probed=True)
        meta.cold = ColdAttention(slot_table, slot_valid, pool, budget, triton=ops)
        out = _decode_attention(q, key_cache, value_cache, meta, head_dim ** -0.5)
        results.append((out, index.lse, meta.decode_mass, meta.cold_mass, meta.cold.selected_blocks))
    for ours, ref in zip(results[1], results[0]):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert results[0][3].amax() > 0.05  # the cold blocks take a share worth comparing

"""The compiled CPU decode-attention kernel against the PyTorch decode path it replaces."""
import pytest
import torch
from kernel_helpers import built_or_skip, run_with_switch

from kvreplay.kernels import cpu_kernels
from kvreplay.layers.attention import AttentionMetadata, _decode_attention


@pytest.fixture(scope="module")
def op():
    return built_or_skip(cpu_kernels.decode_attention(), "CPU decode kernel")


def _case(dtype, num_seqs, lengths, num_kv=3, group=3, head_dim=64, block_size=16, num_blocks=64,
          seed=0):
    gen = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(num_kv, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_kv, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    query = torch.randn(num_seqs, num_kv * group, head_dim, generator=gen).to(dtype)
    width = max(-(-n // block_size) for n in lengths)
    tables = torch.zeros(num_seqs, width, dtype=torch.long)  # padding entries point at block 0
    for row, n in enumerate(lengths):
        used = -(-n // block_size)
        tables[row, :used] = torch.randperm(num_blocks, generator=gen)[:used]
    context = torch.tensor(lengths, dtype=torch.long)
    padding = torch.arange(width * block_size)[None, :] >= context[:, None]
    meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decode_tokens=num_seqs,
                             decode_block_tables=tables,
                             decode_padding=padding.repeat(num_kv, 1).unsqueeze(1))
    return query, key_cache, value_cache, tables, context, meta


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim,group,block_size", [
    (64, 3, 16), (128, 1, 16),  # fixed head sizes, 16-token blocks: the vector block path (AVX-512 or AVX2)
    (64, 7, 16), (128, 3, 16),  # query heads per KV head beyond one register group (4 / 2) and a rest
    (64, 5, 16),                # AVX2's groups of 3 heads and a rest of 2
    (64, 3, 8), (32, 4, 16)])   # other block size / runtime head size: the plain loops
def test_kernel_matches_pytorch_path(op, dtype, tol, head_dim, group, block_size):
    lengths = [1, 15, 16, 17, 100, 300, 47]  # partial and full last blocks, very unequal rows
    query, keys, values, tables, context, meta = _case(dtype, len(lengths), lengths, group=group,
                                                       head_dim=head_dim, block_size=block_size,
                                                       num_blocks=128)
    scale = head_dim ** -0.5
    expected = _decode_attention(query, keys, values, meta, scale).float()
    got, lse, mass = op(query, keys, values, tables, context, scale)
    assert got.dtype == dtype and got.shape == query.shape
    assert (got.float() - expected).abs().max().item() < tol
    assert lse.numel() == 0 and mass.numel() == 0  # not asked for


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_rows_taken_as_views_of_the_fused_qkv(op, dtype):
    """The engine hands q as a view into the fused QKV output (rows 960 values apart): the kernel
    reads it in place, and any layout gives the bits of the contiguous query."""
    lengths = [3, 40, 300]
    query, keys, values, tables, context, _ = _case(dtype, len(lengths), lengths)
    expected, lse_expected, _ = op(query, keys, values, tables, context, 0.125, True, False)
    wide = torch.zeros(len(lengths), 2 * query.shape[1] + 1, query.shape[2], dtype=dtype)
    wide[:, 1:1 + query.shape[1]] = query
    row_strided = wide[:, 1:1 + query.shape[1]]
    assert not row_strided.is_contiguous()
    heads_strided = query.transpose(0, 1).contiguous().transpose(0, 1)  # heads not together
    for view in (row_strided, heads_strided, query[:1]):
        got, lse, _ = op(view, keys, values, tables[:view.shape[0]], context[:view.shape[0]], 0.125, True, False)
        assert got.is_contiguous() and got.shape == view.shape
        assert torch.equal(got, expected[:view.shape[0]]) and torch.equal(lse, lse_expected[:view.shape[0]])


def _reference(query, keys, values, tables, context, scale):
    """fp32 attention row by row from the gathered blocks: out, log-sum-exp [B, Hq], and per KV head
    and block the largest share any of its query heads gives the block [B, Hkv, W]."""
    num_kv, _, block_size, head_dim = keys.shape
    group = query.shape[1] // num_kv
    outs, lses = [], []
    mass = torch.zeros(query.shape[0], num_kv, tables.shape[1])
    for row, n in enumerate(context.tolist()):
        k = keys[:, tables[row]].reshape(num_kv, -1, head_dim)[:, :n].float()      # [Hkv, n, D]
        v = values[:, tables[row]].reshape(num_kv, -1, head_dim)[:, :n].float()
        q = query[row].float().view(num_kv, group, head_dim) * scale
        scores = torch.einsum("hgd,hnd->hgn", q, k)
        probs = scores.softmax(-1)
        outs.append(torch.einsum("hgn,hnd->hgd", probs, v).reshape(-1, head_dim))
        lses.append(scores.logsumexp(-1).flatten())
        padded = torch.nn.functional.pad(probs, (0, -n % block_size))
        shares = padded.view(num_kv, group, -1, block_size).sum(-1).amax(1)         # [Hkv, blocks]
        mass[row, :, :shares.shape[1]] = shares
    return torch.stack(outs), torch.stack(lses), mass


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_lse_and_block_mass(op, dtype, tol):
    lengths = [3, 16, 40, 250]
    query, keys, values, tables, context, _ = _case(dtype, len(lengths), lengths, seed=3)
    out, lse, mass = op(query, keys, values, tables, context, 0.125, True, True)
    want_out, want_lse, want_mass = _reference(query, keys, values, tables, context, 0.125)
    assert (out.float() - want_out).abs().max().item() < tol
    assert (lse - want_lse).abs().max().item() < 1e-4
    assert (mass - want_mass).abs().max().item() < 1e-5
    assert torch.all(mass[0, :, 1:] == 0)  # blocks past a row's context carry no mass


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [16, 8])
def test_long_rows_split_into_chunks_and_merged(op, dtype, tol, block_size):
    """Rows longer than 32 blocks are attended in chunks of 32 and merged by their log-sum-exps:
    the output and lse equal the whole-row reference, and a row's bits are the same alone or in
    any batch (the split depends only on its own length). Asking for block mass keeps rows whole."""
    lengths = [512, 513, 1000, 2049, 37, 1]
    query, keys, values, tables, context, _ = _case(dtype, len(lengths), lengths, seed=5,
                                                    block_size=block_size, num_blocks=320)
    scale = 0.125
    out, lse, _ = op(query, keys, values, tables, context, scale, True, False)
    want_out, want_lse, want_mass = _reference(query, keys, values, tables, context, scale)
    assert (out.float() - want_out).abs().max().item() < tol
    assert (lse - want_lse).abs().max().item() < 1e-4
    for row in (1, 3):
        alone, alone_lse, _ = op(query[row:row + 1], keys, values, tables[row:row + 1], context[row:row + 1],
                                 scale, True, False)
        assert torch.equal(alone, out[row:row + 1]) and torch.equal(alone_lse, lse[row:row + 1])
    whole, whole_lse, mass = op(query, keys, values, tables, context, scale, True, True)
    assert (whole.float() - want_out).abs().max().item() < tol
    assert (whole_lse - want_lse).abs().max().item() < 1e-4
    assert (mass - want_mass).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_threads_or_batch(op, dtype):
    """The threads claim chunks of (sequence, KV head) tasks as they finish (not fixed halves):
    which thread takes a task, how many threads there are and which other rows share the call
    never change a row's bits."""
    lengths = [16 * (1 + i % 11) + i for i in range(40)]  # 120 tasks of unequal lengths
    query, keys, values, tables, context, _ = _case(dtype, len(lengths), lengths, seed=9, num_blocks=256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(query, keys, values, tables, context, 0.125)[0]
    finally:
        torch.set_num_threads(threads)
    both = op(query, keys, values, tables, context, 0.125)[0]
    assert torch.equal(one, both)
    for row in (0, 17, 39):
        alone = op(query[row:row + 1], keys, values, tables[row:row + 1], context[row:row + 1], 0.125)[0]
        assert torch.equal(alone, both[row:row + 1])


def test_kernel_ignores_padding_blocks(op):
    # Rows reach only their own context: changing what padding entries point at changes nothing.
    query, keys, values, tables, context, _ = _case(torch.float32, 2, [5, 200])
    before = op(query, keys, values, tables, context, 0.125)[0]
    tables[0, 1:] = 7
    assert torch.equal(op(query, keys, values, tables, context, 0.125)[0], before)
    tables[0, 1:] = -1  # not even a block id: never read, so not checked
    assert torch.equal(op(query, keys, values, tables, context, 0.125)[0], before)


def test_kernel_rejects_bad_inputs(op):
    query, keys, values, tables, context, _ = _case(torch.float32, 2, [5, 20])
    with pytest.raises(RuntimeError, match="context lengths"):
        op(query, keys, values, tables, torch.tensor([0, 20]), 0.125)
    with pytest.raises(RuntimeError, match="context lengths"):
        op(query, keys, values, tables, torch.tensor([5, 33]), 0.125)  # past the table's blocks
    bad = tables.clone()
    bad[1, 0] = keys.shape[1]
    with pytest.raises(RuntimeError, match="block ids"):
        op(query, keys, values, bad, context, 0.125)
    bad[1, 0], bad[1, 1] = 0, -1  # the last block row 1 reads
    with pytest.raises(RuntimeError, match="block ids"):
        op(query, keys, values, bad, context, 0.125)
    with pytest.raises(RuntimeError, match="head shapes"):
        op(query[:, :4].contiguous(), keys, values, tables, context, 0.125)  # 4 heads over 3 KV heads


@pytest.mark.slow
def test_engine_decodes_through_kernel_and_matches_pytorch_path(op, llm32, monkeypatch):
    """fp32 greedy decoding through the kernel equals the PyTorch path token for token (the
    transformers reference tests run through the kernel too), and the importance it records
    (block mass) equals the PyTorch path's."""
    from kvreplay import SamplingParams
    engine = llm32.engine
    runner = engine.runner
    assert runner.decode_kernel is op
    calls = []
    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = ["The history of the printing press begins in East Asia, where woodblock printing "
               "was used on cloth and later on paper; movable type followed centuries later. "
               "Summarize this in one sentence:", "List three prime numbers:"]
    monkeypatch.setattr(runner, "observe_importance", True)
    seen = {}
    original = engine.kv.importance.observe

    def generate(kernel, label):
        monkeypatch.setattr(runner, "decode_kernel", kernel)
        scores = seen.setdefault(label, [])

        def observe(seq_id, indices, mass, restart=False):  # record what the decode steps hand over
            scores.append(mass.clone())
            return original(seq_id, indices, mass, restart)
        monkeypatch.setattr(engine.kv.importance, "observe", observe)
        out = [o.token_ids for o in llm32.generate(prompts, params)]
        engine.check_integrity()
        return out

    generate(op, "warm-up")  # both compared runs then meet the same prefix cache
    with_kernel = generate(lambda *a: calls.append(1) or op(*a), "kernel")
    assert len(calls) >= 11 * 30  # every decode step, every layer
    assert generate(None, "pytorch") == with_kernel
    assert len(seen["kernel"]) == len(seen["pytorch"]) > 0
    assert max(len(m) for m in seen["kernel"]) >= 3  # several blocks per sequence
    for a, b in zip(seen["kernel"], seen["pytorch"]):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("KVREPLAY_CPU_KERNELS", "0")
    assert not cpu_kernels.enabled()
    assert cpu_kernels.decode_attention() is None


def test_build_is_keyed_by_the_cpu(monkeypatch):
    """-march=native builds: another CPU (a shared home directory) must get its own build."""
    here = cpu_kernels._cpu_signature()
    assert here.strip()  # something identifies this CPU
    names = {}
    for signature in (here, "vendor_id : Other\nflags : sse2"):
        monkeypatch.setattr(cpu_kernels, "_cpu_signature", lambda s=signature: s)
        names[signature] = cpu_kernels.build_name("layer_ops")
    assert len(set(names.values())) == 2
    assert all(n.startswith("kvreplay_layer_ops_") for n in names.values())


def test_a_killed_build_does_not_hang_the_next_one(monkeypatch, tmp_path):
    """torch's build `lock` file outlives a build killed midway, and torch waits on it forever;
    the next start clears it once the dead build's OS lock is gone."""
    import signal
    import subprocess
    import sys
    import time
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from kvreplay.kernels import cpu_kernels\n"
        "with cpu_kernels._build_lock('kvreplay_fake_ext') as d:\n"
        "    (d / 'lock').touch(); print('building', flush=True); time.sleep(600)\n")],
        stdout=subprocess.PIPE, text=True)  # TORCH_EXTENSIONS_DIR inherited
    try:
        assert child.stdout.readline().strip() == "building"
        build_dir = next(tmp_path.rglob("kvreplay_fake_ext"))
        assert (build_dir / "lock").exists()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    start = time.monotonic()
    with cpu_kernels._build_lock("kvreplay_fake_ext") as d:
        assert d == build_dir and not (d / "lock").exists()
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stale_cache_rows_past_the_context_are_never_used(op, dtype):
    """A last block's rows past the context hold whatever an earlier sequence left there, NaN
    included: neither path (vector or AMX tiles, which read a block's 16 rows whole and pair keys
    across blocks) lets them into the output. Lengths end mid-block, on a block, and after an odd
    number of blocks."""
    lengths = [1, 5, 16, 17, 40, 47, 48]
    query, keys, values, tables, context, _ = _case(dtype, len(lengths), lengths, seed=9, num_blocks=128)
    clean_keys, clean_values = keys.clone(), values.clone()
    for row, n in enumerate(lengths):
        last = tables[row, (n - 1) // 16]
        for cache in (keys, values):
            cache[:, last, (n - 1) % 16 + 1:] = float("nan")
    for cache, clean in ((keys, clean_keys), (values, clean_values)):  # every unused block too
        used = torch.zeros(cache.shape[1], dtype=torch.bool)
        for row, n in enumerate(lengths):
            used[tables[row, :-(-n // 16)]] = True
        cache[:, ~used] = float("nan")
        clean[:, ~used] = 0
    got, lse, _ = op(query, keys, values, tables, context, 0.125, True, False)
    want, want_lse, _ = op(query, clean_keys, clean_values, tables, context, 0.125, True, False)
    assert torch.isfinite(got).all() and torch.equal(got, want) and torch.equal(lse, want_lse)


def test_amx_tiles_agree_with_the_vector_kernel(op, tmp_path):
    """On a CPU with AMX tiles, bf16 rows with 16-token blocks and a head size of 64 or 128 run
    on them (scores; values too at 64); KVREPLAY_AMX_ATTENTION=0 (read once per process, hence a
    subprocess) keeps the vector kernel. Both within one bf16 step of each other and of fp32."""
    if not torch.ops.kvreplay_cpu.has_amx_attention():
        pytest.skip("no AMX tiles here: the vector kernel is the one the other tests run")
    cases = [(64, 3), (64, 7), (128, 3), (64, 16)]
    lengths = [1, 15, 16, 17, 47, 100, 300, 513]
    run_with_switch(
        tmp_path, "KVREPLAY_AMX_ATTENTION",
        "import torch\n"
        "from test_cpu_kernels import _case\n"
        "from kvreplay.kernels import cpu_kernels\n"
        "op = cpu_kernels.decode_attention()\n"
        "assert not torch.ops.kvreplay_cpu.has_amx_attention()\n"
        f"outs = [op(*_case(torch.bfloat16, {len(lengths)}, {lengths!r}, head_dim=d, group=g, num_kv=2,\n"
        "                  num_blocks=160, seed=d + g)[:5], 0.125, True, False)[:2] for d, g in "
        f"{cases!r}]\n"
        f"torch.save(outs, {str(tmp_path / 'vector.pt')!r})\n")
    vector = torch.load(tmp_path / "vector.pt")
    for (d, g), (vec_out, vec_lse) in zip(cases, vector):
        case = _case(torch.bfloat16, len(lengths), lengths, head_dim=d, group=g, num_kv=2, num_blocks=160, seed=d + g)
        out, lse = op(*case[:5], 0.125, True, False)[:2]
        exact, exact_lse, _ = _reference(*case[:5], 0.125)
        step = exact.abs().clamp_min(2 ** -8) * 2 ** -7  # one bf16 step, and a floor near zero
        assert ((out.float() - vec_out.float()).abs() <= step).all(), (d, g)
        assert ((out.float() - exact).abs() <= step).all() and ((vec_out.float() - exact).abs() <= step).all()
        assert (lse - vec_lse).abs().max().item() < 1e-4 and (lse - exact_lse).abs().max().item() < 1e-4

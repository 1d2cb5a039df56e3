"""The compiled layer glue (csrc/layer_ops.cpp) against the PyTorch code it replaces in llama.py."""
import pytest
import torch
from kernel_helpers import built_or_skip

from kvreplay.kernels import cpu_kernels
from kvreplay.models.llama import add_rms_norm, rotate_half


@pytest.fixture(scope="module")
def ops():
    return built_or_skip(cpu_kernels.layer_ops(), "layer ops")


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable bf16 values lie between a and b (same-sign inputs)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_fp32_matches_pytorch(ops, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=gen)
    residual = torch.randn(37, 576, generator=gen) if with_residual else None
    weight = torch.rand(576, generator=gen) + 0.5
    normed, hidden = ops.add_rms_norm(x, residual, weight, 1e-5)
    want_normed, want_hidden = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(hidden, want_hidden)  # the add is exact arithmetic either way
    assert torch.allclose(normed, want_normed, rtol=1e-6, atol=1e-6)


def test_add_rms_norm_bf16_rounds_like_pytorch(ops):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 576, generator=gen) * 3).bfloat16()
    residual = torch.randn(64, 576, generator=gen).bfloat16()
    weight = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    normed, hidden = ops.add_rms_norm(x, residual, weight, 1e-6)
    want_normed, want_hidden = add_rms_norm(x, residual, weight, 1e-6)
    assert hidden.dtype == normed.dtype == torch.bfloat16
    assert torch.equal(hidden, want_hidden)
    # Only the order of the fp32 sum of squares differs: at most one bf16 step, rarely.
    apart = _ulps_apart(normed, want_normed)
    assert apart.max().item() <= 1
    assert (apart > 0).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_cache_is_bit_identical_to_pytorch(ops, dtype):
    gen = torch.Generator().manual_seed(2)
    num_q, num_kv, head_dim, tokens, blocks, block_size = 9, 3, 64, 20, 8, 16
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 50
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    cache = torch.randn(2, num_kv, blocks, block_size, head_dim, generator=gen).to(dtype)

    qk = qkv[:, :(num_q + num_kv) * head_dim].view(tokens, num_q + num_kv, head_dim)
    want_qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
    want_cache = cache.clone()
    v = qkv[:, (num_q + num_kv) * head_dim:].view(tokens, num_kv, head_dim)
    want_cache[0].view(num_kv, -1, head_dim)[:, slots] = want_qk[:, num_q:].transpose(0, 1)
    want_cache[1].view(num_kv, -1, head_dim)[:, slots] = v.transpose(0, 1)

    got = qkv.clone()
    ops.rope_write_cache(got, cos, sin, num_q, num_kv, cache, slots)
    assert torch.equal(got[:, :(num_q + num_kv) * head_dim].view_as(want_qk), want_qk)
    assert torch.equal(got[:, (num_q + num_kv) * head_dim:], qkv[:, (num_q + num_kv) * head_dim:])
    assert torch.equal(cache, want_cache)  # the slots written, every other row untouched


def test_layer_ops_reject_bad_inputs(ops):
    qkv = torch.randn(2, 15 * 64)
    cos = sin = torch.ones(2, 64)
    cache = torch.zeros(2, 3, 4, 16, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_write_cache(qkv, cos, sin, 9, 3, cache, torch.tensor([0, 64]))
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_write_cache(qkv, cos, sin, 9, 3, cache, torch.tensor([-1, 3]))
    with pytest.raises(RuntimeError, match="qkv must be"):
        ops.rope_write_cache(qkv, cos, sin, 8, 3, cache, torch.tensor([0, 1]))  # wrong head count
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.rope_write_cache(qkv.bfloat16(), cos.bfloat16(), sin.bfloat16(), 9, 3, cache, torch.tensor([0, 1]))
    assert torch.count_nonzero(cache) == 0  # nothing written by a rejected call
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.add_rms_norm(torch.randn(2, 8), None, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="residual must match"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)


def test_model_forward_with_and_without_layer_ops(ops, llm32):
    """fp32 logits of a prefill and a decode step agree with the PyTorch layer code."""
    from kvreplay import SamplingParams
    engine = llm32.engine
    model = engine.runner.model
    assert model.layer_ops is ops
    logits = {}
    original = model.forward

    def capture(label):
        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            logits.setdefault(label, []).append(out.clone())
            return out
        return forward

    prompts = ["Explain why the sky is blue in two sentences.", "Count: one, two, three,"]
    params = SamplingParams(max_tokens=6, temperature=0)
    tokens = {}
    try:
        # a warm-up first, so that both compared runs meet the same prefix cache
        for label, layer_ops in (("warm-up", ops), ("ops", ops), ("pytorch", None)):
            model.layer_ops = layer_ops
            model.forward = capture(label)
            tokens[label] = [o.token_ids for o in llm32.generate(prompts, params)]
            engine.check_integrity()
    finally:
        model.layer_ops = ops
        del model.forward
    assert tokens["ops"] == tokens["pytorch"]
    assert len(logits["ops"]) == len(logits["pytorch"]) >= 6
    for a, b in zip(logits["ops"], logits["pytorch"]):
        assert a.shape == b.shape and (a - b).abs().max().item() < 1e-3


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("KVREPLAY_CPU_KERNELS", "0")
    assert cpu_kernels.layer_ops() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_pytorch(ops, dtype):
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(33, 2 * 1536 + 2 * 8, generator=gen) * 4).to(dtype)  # a tail past 16 lanes
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero inputs
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = ops.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    else:  # the exp differs from the library's in its last fp32 bits: one bf16 step at most, rarely
        step = want.float().abs().clamp_min(1e-6) * 2 ** -7
        assert ((got.float() - want.float()).abs() <= step).all()
        assert (got != want).float().mean().item() < 0.01
    with pytest.raises(RuntimeError, match="gate_up must be"):
        ops.silu_mul(torch.randn(2, 7))


def test_argmax_rows_is_torch_argmax(ops):
    """Greedy decoding's argmax: torch.argmax's index on every row, ties (first), NaN (first
    NaN), infinities, rows shorter than a vector and a tail past the last full vector."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(33, 49152 + 7, generator=gen)
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(-1))
    odd = torch.zeros(7, 40)
    odd[1, [7, 30]] = 1.0                        # a tie across lanes: the first
    odd[2, [20, 3]] = float("nan")               # NaN wins, the first one
    odd[3] = float("-inf")                       # all -inf: index 0
    odd[4, 39] = float("inf")                    # in the scalar tail
    odd[5, [16, 32]] = 2.0                       # a tie within one lane
    odd[6, 38] = float("nan")                    # NaN in the tail only
    assert ops.argmax_rows(odd).tolist() == odd.argmax(-1).tolist() == [0, 7, 3, 0, 39, 16, 38]
    short = torch.randn(4, 5, generator=gen)
    assert torch.equal(ops.argmax_rows(short), short.argmax(-1))
    strided = logits[:, ::2]
    assert torch.equal(ops.argmax_rows(strided), strided.argmax(-1))
    assert ops.argmax_rows(torch.zeros(0, 9)).shape == (0,)
    with pytest.raises(RuntimeError, match="argmax_rows: x must be"):
        ops.argmax_rows(torch.zeros(3, 9).bfloat16())
    with pytest.raises(RuntimeError, match="argmax_rows: x must be"):
        ops.argmax_rows(torch.zeros(3, 0))


def test_greedy_sampling_uses_the_compiled_argmax(ops, monkeypatch):
    from kvreplay import sampling
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(6))
    calls = []
    real = ops.argmax_rows
    monkeypatch.setattr(cpu_kernels, "layer_ops", lambda: type("Ops", (), {
        "argmax_rows": staticmethod(lambda x: calls.append(x.shape) or real(x))}))
    params = [sampling.SamplingParams(temperature=0)] * 6
    assert torch.equal(sampling.sample(logits, params, [None] * 6), logits.argmax(-1))
    assert calls == [(6, 1000)]


def _fused_and_python_runs(llm, prompts, params) -> dict:
    """Generate `prompts` once through decode_layer(s) and once through the Python layer code
    (fused_rows 0), checking the blocks every step. Per run: tokens, every step's logits and
    recorded block importance, and per step (layers run compiled, whether it was a decode-only
    step with a need probe, layers run by decode_layers)."""
    model = llm.engine.runner.model
    if not any(model.fused_rows):
        pytest.skip("no panel kernel on this CPU: decode_layer is never used")
    fused_rows, original_forward, original_layer = model.fused_rows, model.forward, model.decode_layer
    original_stack = model.decode_layers
    runs = {label: {"logits": [], "masses": [], "steps": []} for label in ("fused", "python")}
    calls = []

    def capture(run):
        def forward(*args, **kwargs):
            calls.clear()
            out = original_forward(*args, **kwargs)
            input_ids, meta = args[0], args[3]
            decode_only = not meta.prefills and meta.num_decode_tokens == input_ids.shape[0]
            run["steps"].append((len(calls), decode_only and meta.probe is not None, calls.count("stack")))
            run["logits"].append(out.clone())
            if meta.decode_mass is not None:
                run["masses"].append(meta.decode_mass.clone())
            return out
        return forward

    def counted(*args, **kwargs):
        calls.append("layer")
        return original_layer(*args, **kwargs)

    def counted_stack(delta, cos, sin, kv_caches, meta):
        calls.extend(["stack"] * len(kv_caches))
        return original_stack(delta, cos, sin, kv_caches, meta)

    try:
        model.decode_layer, model.decode_layers = counted, counted_stack
        for label, rows in (("fused", fused_rows), ("python", [0] * len(fused_rows))):
            model.fused_rows = rows
            model.forward = capture(runs[label])
            outs = llm.generate(prompts, params, on_step=lambda e: e.check_integrity())
            runs[label]["tokens"] = [o.token_ids for o in outs]
    finally:
        model.fused_rows = fused_rows
        del model.forward, model.decode_layer, model.decode_layers
    assert all(n == 0 for n, _, _ in runs["python"]["steps"])
    return runs


def _assert_same_bits(runs: dict) -> None:
    fused, python = runs["fused"], runs["python"]
    assert fused["tokens"] == python["tokens"]
    for key in ("logits", "masses"):
        assert len(fused[key]) == len(python[key])
        for a, b in zip(fused[key], python[key]):
            assert torch.equal(a, b)


def test_decode_layer_gives_the_layer_codes_bits(ops):
    """bf16 decode steps through decode_layer (one compiled call a layer) give the logits of the
    Python layer code bit for bit, for short rows and a row split into chunks (> 512 tokens),
    with every step's blocks checked."""
    from kvreplay import LLM, SamplingParams
    from kvreplay.bench.workload import corpus_token_ids
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", enable_prefix_caching=False)
    corpus = corpus_token_ids(llm.tokenizer)
    prompts = [corpus[:600], corpus[1000:1040], corpus[2000:2003]]
    runs = _fused_and_python_runs(llm, prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    num_layers = llm.engine.model.config.num_layers
    # the 5 decode steps after the prefill, every layer, in one decode_layers call a step
    assert sum(n for n, _, _ in runs["fused"]["steps"]) == 5 * num_layers
    assert sum(stacked for _, _, stacked in runs["fused"]["steps"]) == 5 * num_layers
    assert len(runs["fused"]["logits"]) >= 6  # prompt chunks, then 5 decode steps
    _assert_same_bits(runs)


def test_decode_layer_rejects_bad_weights(ops):
    """A wrong panel tensor is a clear error naming the projection, not a crash."""
    if not hasattr(ops, "decode_layer") or not ops.has_panel_linear():
        pytest.skip("no panel kernel on this CPU")
    built_or_skip(cpu_kernels.decode_attention(), "CPU decode kernel")
    H, D, Hq, Hkv, F = 64, 16, 4, 2, 96
    bf = torch.bfloat16
    panels = lambda out, inp: ops.pack_panels(torch.randn(out, inp).to(bf))  # noqa: E731
    cache = torch.zeros(2, Hkv, 4, 16, D, dtype=bf)
    args = dict(delta=torch.randn(2, H).to(bf), residual=None, input_norm=torch.ones(H, dtype=bf),
                post_norm=torch.ones(H, dtype=bf), eps=1e-5, qkv=panels((Hq + 2 * Hkv) * D, H), qkv_bias=None,
                o=panels(H, Hq * D), o_bias=None, gate_up=panels(2 * F, H), gate_up_bias=None,
                down=panels(H, F), down_bias=None, cos=torch.ones(2, D, dtype=bf), sin=torch.zeros(2, D, dtype=bf),
                num_q=Hq, num_kv=Hkv, kv_cache=cache, slot_mapping=torch.tensor([0, 16]),
                block_tables=torch.tensor([[0], [1]]), context_lens=torch.tensor([1, 1]), scale=0.25)
    out, hidden, mass = ops.decode_layer(*args.values())
    assert out.shape == hidden.shape == (2, H) and torch.isfinite(out.float()).all()
    assert mass.numel() == 0  # not asked for
    _, _, mass = ops.decode_layer(*args.values(), True)
    assert mass.shape == (2, 1) and torch.allclose(mass, torch.ones(2, 1))  # one key: all its mass
    written = cache.clone()
    for name, bad in (("qkv", panels(Hq * D, H)), ("o", panels(H, 2 * Hq * D)), ("down", panels(H, 2 * F))):
        cache.zero_()
        with pytest.raises(RuntimeError, match=rf"decode_layer: {name} weight"):
            ops.decode_layer(*{**args, name: bad}.values())
        assert not cache.any()  # refused before anything was written
    assert written.any()  # (the good call did write its tokens' K/V)


def _tiny_stack(ops, layers: int, bias: bool):
    """Random layers of a tiny model for decode_layer(s): per-layer weights and biases in
    decode_layers' order, one cache per layer, and the step's shared arguments."""
    H, D, Hq, Hkv, F = 64, 16, 4, 2, 96
    bf = torch.bfloat16
    panels = lambda out, inp: ops.pack_panels((torch.randn(out, inp) / inp ** 0.5).to(bf))  # noqa: E731
    vector = lambda n: (torch.randn(n) * 0.1).to(bf) if bias else None  # noqa: E731
    weights, biases = [], []
    for _ in range(layers):
        weights += [(1 + 0.1 * torch.randn(H)).to(bf), (1 + 0.1 * torch.randn(H)).to(bf),
                    panels((Hq + 2 * Hkv) * D, H), panels(H, Hq * D), panels(2 * F, H), panels(H, F)]
        biases += [vector((Hq + 2 * Hkv) * D), vector(H), vector(2 * F), vector(H)]
    caches = [(torch.randn(2, Hkv, 4, 16, D) * 0.5).to(bf) for _ in range(layers)]
    angles = torch.randn(3, D)
    step = dict(cos=angles.cos().to(bf), sin=angles.sin().to(bf), num_q=Hq, num_kv=Hkv,
                slot_mapping=torch.tensor([5, 16 + 20, 48 + 2]),
                block_tables=torch.tensor([[0, 3], [2, 1], [3, 0]]), context_lens=torch.tensor([6, 21, 3]),
                scale=D ** -0.5)
    return H, weights, biases, caches, step


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_decode_layers_equal_decode_layer_one_by_one(ops, bias, residual):
    """decode_layers over a stack (its layers sharing buffers, the residual written in place)
    gives decode_layer's outputs, masses and cache writes layer by layer, bit for bit, and leaves
    its inputs as they were."""
    if not hasattr(ops, "decode_layers") or not ops.has_panel_linear():
        pytest.skip("no panel kernel on this CPU")
    built_or_skip(cpu_kernels.decode_attention(), "CPU decode kernel")
    torch.manual_seed(0)
    H, weights, biases, caches, step = _tiny_stack(ops, 3, bias)
    delta = torch.randn(3, H).to(torch.bfloat16)
    stream = torch.randn(3, H).to(torch.bfloat16) if residual else None
    kept = (delta.clone(), None if stream is None else stream.clone())
    one_by_one = [c.clone() for c in caches]
    d, r, masses = delta, stream, []
    for i, cache in enumerate(one_by_one):
        norms_and_panels, b = weights[6 * i:6 * i + 6], biases[4 * i:4 * i + 4]
        d, r, mass = ops.decode_layer(d, r, norms_and_panels[0], norms_and_panels[1], 1e-5,
                                      norms_and_panels[2], b[0], norms_and_panels[3], b[1], norms_and_panels[4], b[2],
                                      norms_and_panels[5], b[3], step["cos"], step["sin"], step["num_q"],
                                      step["num_kv"], cache, step["slot_mapping"], step["block_tables"],
                                      step["context_lens"], step["scale"], True)
        masses.append(mass)
    out, hidden, stacked = ops.decode_layers(delta, stream, weights, biases, 1e-5, step["cos"], step["sin"],
                                             step["num_q"], step["num_kv"], caches, step["slot_mapping"],
                                             step["block_tables"], step["context_lens"], step["scale"], True)
    assert torch.equal(out, d) and torch.equal(hidden, r)
    assert len(stacked) == 3 and all(torch.equal(a, b) for a, b in zip(stacked, masses))
    assert all(torch.equal(a, b) for a, b in zip(caches, one_by_one))
    assert torch.equal(delta, kept[0]) and (stream is None or torch.equal(stream, kept[1]))
    _, _, none = ops.decode_layers(delta, stream, weights, biases, 1e-5, step["cos"], step["sin"], step["num_q"],
                                   step["num_kv"], caches, step["slot_mapping"], step["block_tables"],
                                   step["context_lens"], step["scale"])
    assert none == []  # masses only when asked for


def test_decode_layers_rejects_a_bad_stack_before_writing(ops):
    """Wrong list lengths, a wrong weight or cache in any layer: a clear error naming the layer,
    raised before any layer's cache is written."""
    if not hasattr(ops, "decode_layers") or not ops.has_panel_linear():
        pytest.skip("no panel kernel on this CPU")
    built_or_skip(cpu_kernels.decode_attention(), "CPU decode kernel")
    H, weights, biases, caches, step = _tiny_stack(ops, 3, False)
    delta = torch.randn(3, H).to(torch.bfloat16)
    before = [c.clone() for c in caches]

    def call(w=weights, b=biases, c=caches, d=delta):
        return ops.decode_layers(d, None, w, b, 1e-5, step["cos"], step["sin"], step["num_q"], step["num_kv"],
                                 c, step["slot_mapping"], step["block_tables"], step["context_lens"], step["scale"])

    wrong_o = weights[:6 * 2 + 3] + [ops.pack_panels(torch.randn(H, 32).to(torch.bfloat16))] + weights[6 * 2 + 4:]
    wrong_norm = weights[:6 * 2] + [weights[6 * 2].float()] + weights[6 * 2 + 1:]
    wrong_bias = biases[:4 * 2 + 3] + [torch.zeros(H + 1, dtype=torch.bfloat16)]
    wrong_cache = caches[:1] + [caches[1][:, :, :2].contiguous()] + caches[2:]
    for kwargs, message in ((dict(w=weights[:-1]), "3 caches need 6 weights and 4 biases a layer"),
                            (dict(b=biases[:4]), "3 caches need 6 weights and 4 biases a layer"),
                            (dict(c=[]), "0 caches"),
                            (dict(w=wrong_o), "layer 2 o weight is"),
                            (dict(w=wrong_norm), "layer 2 norm weights must be contiguous bf16"),
                            (dict(b=wrong_bias), "layer 2 down bias must be bf16"),
                            (dict(c=wrong_cache), "layer 1 kv_cache differs"),
                            (dict(d=delta.float()), "delta must be a contiguous bf16")):
        with pytest.raises(RuntimeError, match=message):
            call(**kwargs)
        assert all(torch.equal(a, b) for a, b in zip(caches, before))  # nothing written
    out, _, _ = call()
    assert out.shape == (3, H) and not all(torch.equal(a, b) for a, b in zip(caches, before))


def test_decode_layer_leaves_the_need_detectors_layers_to_the_layer_code(ops):
    """With the replay policy's need detector reading layers 20-23, a decode step runs the other
    layers through decode_layer and those four through the layer code (which hands the detector
    its log-sum-exps); tokens, logits and the block importance the steps record are the Python
    path's bit for bit."""
    from kvreplay import LLM, SamplingParams
    from kvreplay.bench.workload import corpus_token_ids
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", enable_prefix_caching=False, policy="replay",
              trim="prefill", resident_ratio=0.2, window_tokens=128, need_layers="20-23")
    corpus = corpus_token_ids(llm.tokenizer)
    prompts = [corpus[:1200], corpus[3000:4000]]
    runs = _fused_and_python_runs(llm, prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    num_layers = llm.engine.model.config.num_layers
    probed = [n for n, probe, stacked in runs["fused"]["steps"] if probe]
    assert probed and set(probed) == {num_layers - 4}  # the detector's four layers in Python
    assert len(runs["fused"]["masses"]) >= 4
    _assert_same_bits(runs)


def test_decode_layers_hand_on_every_layers_block_mass(ops):
    """The window policy records block importance at decode without a need probe: its decode
    steps run the whole stack in one decode_layers call, and the mass summed over the layers, the
    logits and the tokens are the Python layer code's bit for bit."""
    from kvreplay import LLM, SamplingParams
    from kvreplay.bench.workload import corpus_token_ids
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", enable_prefix_caching=False, policy="window",
              window_tokens=128)
    corpus = corpus_token_ids(llm.tokenizer)
    prompts = [corpus[:700], corpus[3000:3300]]
    runs = _fused_and_python_runs(llm, prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    num_layers = llm.engine.model.config.num_layers
    assert [stacked for _, _, stacked in runs["fused"]["steps"] if stacked] == [num_layers] * 4
    assert len(runs["fused"]["masses"]) >= 4
    _assert_same_bits(runs)


def test_need_probe_skips_only_the_layers_it_does_not_read():
    from kvreplay.layers.attention import NeedProbe
    probe = NeedProbe(rows=torch.zeros(0), slot_table=torch.zeros(0), valid=torch.zeros(0), key_index=None,
                      top_blocks=1, layers=frozenset({1}))
    assert probe.skip_layer() and probe.layer == 1
    assert not probe.skip_layer() and probe.layer == 1  # layer 1 is read: the caller runs it
    assert probe.next_layer() == 1 and probe.skip_layer() and probe.layer == 3
    every = NeedProbe(rows=torch.zeros(0), slot_table=torch.zeros(0), valid=torch.zeros(0), key_index=None,
                      top_blocks=1)
    assert not every.skip_layer() and every.next_layer() == 0


def test_fused_decode_switch(monkeypatch):
    """KVREPLAY_FUSED_DECODE=0 keeps every layer on the Python layer code; a bad value is an error."""
    from kvreplay import LLM
    from kvreplay.models.llama import fused_decode_enabled
    monkeypatch.delenv("KVREPLAY_FUSED_DECODE", raising=False)
    assert fused_decode_enabled()
    for value, expected in (("1", True), (" 0 ", False)):
        monkeypatch.setenv("KVREPLAY_FUSED_DECODE", value)
        assert fused_decode_enabled() is expected
    monkeypatch.setenv("KVREPLAY_FUSED_DECODE", "yes")
    with pytest.raises(ValueError, match="KVREPLAY_FUSED_DECODE must be 0 or 1"):
        fused_decode_enabled()
    monkeypatch.setenv("KVREPLAY_FUSED_DECODE", "0")
    llm = LLM(dtype="bfloat16", kv_cache_memory="16MiB")
    assert not any(llm.engine.runner.model.fused_rows)

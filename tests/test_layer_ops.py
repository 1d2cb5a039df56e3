"""The compiled layer glue (csrc/layer_ops.cpp) against the PyTorch code it replaces in llama.py."""
import pytest
import torch
from kernel_helpers import built_or_skip

from kvreplay.engine import cpu_kernels
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

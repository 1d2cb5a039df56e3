"""The compiled causal attention for bf16 prompt chunks (fresh, or over cached positions) against
exact fp32 attention and SDPA."""
import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import built_or_skip

from kvreplay.kernels import cpu_kernels


@pytest.fixture(scope="module")
def op():
    built_or_skip(cpu_kernels.decode_attention(), "CPU attention kernels")
    kernel = cpu_kernels.prefill_attention(only_where_faster=False)
    if kernel is None:
        pytest.skip("this CPU has no AVX512-BF16: prefill chunks run through SDPA")
    return kernel


def _qkv(tokens, num_q, num_kv, head_dim, seed=0):
    """q, k, v as the model hands them over: views into one fused [T, (Hq + 2 Hkv) D] output."""
    gen = torch.Generator().manual_seed(seed)
    fused = (torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, generator=gen) * 2).bfloat16()
    q = fused[:, :num_q * head_dim].view(tokens, num_q, head_dim)
    k = fused[:, num_q * head_dim:(num_q + num_kv) * head_dim].view(tokens, num_kv, head_dim)
    v = fused[:, (num_q + num_kv) * head_dim:].view(tokens, num_kv, head_dim)
    return q, k, v


def _visible(tokens, offset):
    """[T, offset + T]: query i (position offset + i) sees keys 0 .. offset + i."""
    return torch.arange(offset + tokens)[None, :] <= torch.arange(offset, offset + tokens)[:, None]


def _exact(q, k, v, scale, offset=0):
    """Causal attention in fp32 on the same bf16 inputs: [T, Hq, D]."""
    tokens, group = q.shape[0], q.shape[1] // k.shape[1]
    keys = k.float().transpose(0, 1).repeat_interleave(group, 0)
    values = v.float().transpose(0, 1).repeat_interleave(group, 0)
    scores = q.float().transpose(0, 1) @ keys.transpose(1, 2) * scale
    scores.masked_fill_(~_visible(tokens, offset), float("-inf"))
    return (torch.softmax(scores, -1) @ values).transpose(0, 1)


def _sdpa(q, k, v, scale, offset=0):
    mask = None if offset == 0 else _visible(q.shape[0], offset)
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          v.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("tokens,num_q,num_kv,head_dim", [
    (1, 9, 3, 64), (5, 9, 3, 64), (16, 9, 3, 64), (37, 9, 3, 64), (128, 9, 3, 64),  # the default model
    (300, 8, 2, 128), (70, 4, 4, 64), (33, 2, 1, 64), (48, 10, 2, 64)])  # other heads, row tails
def test_prefill_kernel_is_as_close_to_exact_as_sdpa(op, tokens, num_q, num_kv, head_dim):
    q, k, v = _qkv(tokens, num_q, num_kv, head_dim)
    scale = head_dim ** -0.5
    exact = _exact(q, k, v, scale)
    ours = op(q, k, v, scale)
    assert ours.shape == (tokens, num_q, head_dim) and ours.dtype == torch.bfloat16
    ours_err = (ours.float() - exact).abs().max().item()
    sdpa_err = (_sdpa(q, k, v, scale).float() - exact).abs().max().item()
    # bf16 output rounding alone is half a step at the largest output (~0.016 here)
    assert ours_err <= max(sdpa_err, 0.5 * 2.0 ** -7 * exact.abs().max().item()) * 1.05 + 1e-6, \
        (ours_err, sdpa_err)
    if tokens > 1:  # causal: the first token attends to itself only
        assert torch.equal(ours[0].float(), v[0].float().repeat_interleave(num_q // num_kv, 0))


@pytest.mark.parametrize("tokens,offset", [(1, 7), (16, 16), (37, 100), (128, 3), (200, 512)])
def test_prefill_kernel_over_cached_positions(op, tokens, offset):
    """A later chunk: its keys are the cached positions (head-major, gathered from the cache)
    followed by its own; query i sits at position offset + i."""
    gen = torch.Generator().manual_seed(tokens + offset)
    q = (torch.randn(tokens, 9, 64, generator=gen) * 2).bfloat16()
    k_heads = (torch.randn(3, offset + tokens, 64, generator=gen) * 2).bfloat16()  # [Hkv, L, D]
    v_heads = (torch.randn(3, offset + tokens, 64, generator=gen) * 2).bfloat16()
    k, v = k_heads.transpose(0, 1), v_heads.transpose(0, 1)                     # [L, Hkv, D] views
    exact = _exact(q, k, v, 0.125, offset)
    ours_err = (op(q, k, v, 0.125, offset).float() - exact).abs().max().item()
    sdpa_err = (_sdpa(q, k, v, 0.125, offset).float() - exact).abs().max().item()
    assert ours_err <= max(sdpa_err, 0.5 * 2.0 ** -7 * exact.abs().max().item()) * 1.05 + 1e-6, \
        (ours_err, sdpa_err)


def test_prefill_kernel_rejects_bad_inputs(op):
    q, k, v = _qkv(20, 9, 3, 64)
    with pytest.raises(RuntimeError, match="bf16"):
        op(q.float(), k.float(), v.float(), 0.125)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        op(q, k, v[:, :2], 0.125)  # values of 2 KV heads, keys of 3
    with pytest.raises(RuntimeError, match="shapes disagree"):
        op(q[:, :8], k, v, 0.125)  # 8 query heads over 3 KV heads
    with pytest.raises(RuntimeError, match="head size"):
        op(q[..., :32], k[..., :32], v[..., :32], 0.125)
    with pytest.raises(RuntimeError, match="values must be contiguous"):
        op(torch.zeros(20, 9, 128, dtype=torch.bfloat16)[..., :64], k, v, 0.125)  # query heads 128 apart
    with pytest.raises(RuntimeError, match="offset's 4 cached positions"):
        op(q, k, v, 0.125, 4)  # 20 keys for 4 cached + 20 new positions


@pytest.mark.slow
def test_engine_prefills_bf16_chunks_through_the_kernel(op, llm32):
    """A 700-token prompt (a fresh 512-token chunk, then 188 tokens over 512 cached positions)
    through the bf16 engine with the kernel and with SDPA:
    next-token log-probs against the fp32 engine's. Both are bf16 models, so both are off by
    bf16 noise (0.04-0.2 in log-prob on four prompts measured, either one sometimes the closer);
    a broken kernel is off by whole units."""
    from kvreplay import LLM, SamplingParams
    from kvreplay.bench.workload import corpus_token_ids
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", enable_prefix_caching=False)
    runner = llm.engine.runner
    chosen = runner.prefill_kernel  # the kernel, except on an AMX CPU (SDPA is faster there)
    assert chosen is cpu_kernels.prefill_attention() and chosen in (op, None)
    prompt = corpus_token_ids(llm.tokenizer)[:700]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    exact = llm32.generate(prompt, params).outputs[0]
    calls = []
    runner.prefill_kernel = lambda *args: calls.append(1) or op(*args)
    ours = llm.generate(prompt, params, on_step=lambda e: e.check_integrity()).outputs[0]
    runner.prefill_kernel = None
    sdpa = llm.generate(prompt, params).outputs[0]
    runner.prefill_kernel = chosen
    assert len(calls) == 2 * llm.engine.model.config.num_layers  # every layer of both chunks
    assert ours.token_ids == exact.token_ids == sdpa.token_ids

    def error(out):
        return max(abs(out.logprobs[0][t] - lp) for t, lp in exact.logprobs[0].items() if t in out.logprobs[0])
    assert len(set(ours.logprobs[0]) & set(exact.logprobs[0])) >= 5  # the chosen token and most of the top 5
    assert error(ours) <= max(0.25, 2 * error(sdpa)), (error(ours), error(sdpa))

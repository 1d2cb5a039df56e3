"""Exactness against Hugging Face transformers on the same GGUF weights (fp32)."""
from __future__ import annotations

import torch

from kvreplay import SamplingParams
from kvreplay.layers.attention import AttentionMetadata, PrefillSlice
from kvreplay.kv import KVManager

LOGIT_TOLERANCE = 1e-3  # absolute, on logits of magnitude ~40; fp32 on both sides


def _chunked_logits(model, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position, computed chunk by chunk through the paged cache."""
    cfg, device = model.config, model.device
    block_size = 16
    num_blocks = -(-len(token_ids) // block_size) + 1
    kv = KVManager(num_blocks, block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                   torch.float32, device)
    # A scrambled block table: pages need not be contiguous or ordered.
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    pieces = []
    for start in range(0, len(token_ids), chunk):
        end = min(start + chunk, len(token_ids))
        positions = torch.arange(start, end)
        slots = table[positions // block_size] * block_size + positions % block_size
        mask = None if start == 0 else torch.arange(end)[None, :] <= positions[:, None]
        if mask is not None:
            mask = mask.to(device)
        meta = AttentionMetadata(slot_mapping=slots.to(device),
                                 prefills=[PrefillSlice(0, end - start, end, table.to(device), mask,
                                                        causal_from=start)])
        pieces.append(model.forward(torch.tensor(token_ids[start:end], device=device), positions.to(device),
                                    kv.kv_caches, meta, None))
    return torch.cat(pieces).cpu()


def test_logits_match_transformers_on_1500_tokens(llm32, hf_reference, real_text):
    ids = llm32.tokenizer(real_text).input_ids[:1500]
    assert len(ids) == 1500
    with torch.no_grad():
        expected = hf_reference(torch.tensor([ids])).logits[0]
    for chunk in (1500, 384):
        ours = _chunked_logits(llm32.engine.model, ids, chunk)
        diff = (ours - expected).abs().max().item()
        assert diff < LOGIT_TOLERANCE, f"chunk={chunk}: max |logit diff| = {diff}"
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def _hf_greedy(hf_reference, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=2)
    return out[0, len(ids):].tolist()


def _assert_same_greedy(llm, hf_reference, ids: list[int], ours: list[int], max_new_tokens: int, label):
    """Our greedy tokens equal transformers' greedy tokens. On the CPU exactly. On a GPU the float
    sums run in another order, so a near tie may go the other way: there the two may part at one
    step, provided transformers' own logits there rate our token within 2 x LOGIT_TOLERANCE of its
    choice (each side is within LOGIT_TOLERANCE of the other's logits); what follows that step is
    not compared, since the two continue from different tokens."""
    expected = _hf_greedy(hf_reference, ids, max_new_tokens)
    if llm.engine.model.device.type == "cpu" or ours == expected:
        assert ours == expected, label
        return
    step = next((i for i, (a, b) in enumerate(zip(ours, expected)) if a != b), None)
    assert step is not None, f"{label}: one stopped early: {ours} vs {expected}"
    with torch.no_grad():
        logits = hf_reference(torch.tensor([ids + expected[:step]])).logits[0, -1]
    margin = (logits[expected[step]] - logits[ours[step]]).item()
    assert margin <= 2 * LOGIT_TOLERANCE, (f"{label}: parted at step {step} ({ours[step]} vs {expected[step]}), "
                                           f"transformers' margin {margin:.2e} is no tie")


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate. Answer in pirate speak."},
     {"role": "user", "content": "Tell me about the sea."}],
    [{"role": "user", "content": "Write a haiku about memory."}],
    [{"role": "system", "content": "You answer with one word."},
     {"role": "user", "content": "What color is the sky?"}],
]


def test_greedy_chat_matches_transformers_generate(llm32, hf_reference):
    params = SamplingParams(max_tokens=40, temperature=0)
    outputs = llm32.chat(CONVERSATIONS, params, on_step=lambda e: e.check_integrity())
    for conversation, output in zip(CONVERSATIONS, outputs):
        _assert_same_greedy(llm32, hf_reference, llm32.chat_prompt_ids(conversation), output.token_ids, 40,
                            conversation)


def test_greedy_long_raw_prompt_matches_transformers(llm32, hf_reference, real_text):
    ids = llm32.tokenizer(real_text[20000:]).input_ids[:1200]
    output = llm32.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                            on_step=lambda e: e.check_integrity())
    _assert_same_greedy(llm32, hf_reference, ids, output.token_ids, 24, "long raw prompt")

"""Gemma 3 270M (models/gemma3.py) against transformers' Gemma 3 on the same dequantized weights,
fp32, over the hybrid KV pool (kv/local_groups.py) and over the pool in which every layer keeps
every block, greedy and beam search; its facts read from the GGUF; the inputs and settings it refuses.

transformers' model is built from our loader's tensors (its GGUF path would dequantize the file a
second time): the GGUF's norms are llama.cpp's 1 + w, transformers adds the 1 itself."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from kvreplay import LLM, SamplingParams
from kvreplay.engine import llm_engine
from kvreplay.engine.model_setup import EngineModel
from kvreplay.layers.linear import Projection
from kvreplay.models.config import ModelConfig
from kvreplay.models.gemma3 import Gemma3Model
from kvreplay.models.loader import load_model, read_model_config
from tests.test_reference import _chunked_logits  # a scrambled block table, chunk by chunk

MODEL = "gemma3-270m"
LOGIT_TOLERANCE = 1e-3  # absolute, fp32 on both sides (as tests/test_reference.py)
VOCAB_SAMPLE = 8192     # vocabulary rows whose logits are compared at every position


def _engine_on(gemma32, **knobs) -> LLM:
    """Another fp32 engine over gemma32's model object (no second load), with `knobs`."""
    engine = gemma32.engine
    loaded = EngineModel(engine.model, engine.tokenizer, engine.model_source, engine.max_model_len)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_engine, "load_engine_model", lambda config: loaded)
        return LLM(model=MODEL, dtype="float32", **{"kv_cache_memory": "128MiB", "max_num_batched_tokens": 512} | knobs)


def _checked(engine) -> None:
    """After a step: the pool is consistent and no sequence's local groups hold more than the
    blocks its next query's window reads."""
    engine.check_integrity()
    local = engine.kv.local
    for seq_id in local.tables:
        assert local.num_held(seq_id) <= local.window_blocks, f"seq {seq_id}: {local.num_held(seq_id)} local blocks"


def _weights_of(model: Gemma3Model) -> dict[str, torch.Tensor]:
    """The fp32 model's tensors under transformers' names (views; norms as the GGUF's 1 + w)."""
    cfg = model.config
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    weights = {"model.embed_tokens.weight": model.embed_tokens, "model.norm.weight": model.norm}
    for i, layer in enumerate(model.layers):
        assert not layer["qkv"].packed, "fp32 projections keep their plain weight"
        qkv, gate_up, prefix = layer["qkv"].weight, layer["gate_up"].weight, f"model.layers.{i}."
        weights |= {prefix + name: tensor for name, tensor in {
            "input_layernorm.weight": layer["input_norm"],
            "post_attention_layernorm.weight": layer["post_attention_norm"],
            "pre_feedforward_layernorm.weight": layer["pre_mlp_norm"],
            "post_feedforward_layernorm.weight": layer["post_mlp_norm"],
            "self_attn.q_norm.weight": layer["q_norm"], "self_attn.k_norm.weight": layer["k_norm"],
            "self_attn.q_proj.weight": qkv[:q_rows], "self_attn.k_proj.weight": qkv[q_rows:q_rows + kv_rows],
            "self_attn.v_proj.weight": qkv[q_rows + kv_rows:], "self_attn.o_proj.weight": layer["o"].weight,
            "mlp.gate_proj.weight": gate_up[:cfg.intermediate_size],
            "mlp.up_proj.weight": gate_up[cfg.intermediate_size:], "mlp.down_proj.weight": layer["down"].weight,
        }.items()}
    return weights


@pytest.fixture(scope="module")
def weights(gemma32):
    return _weights_of(gemma32.engine.model)


@pytest.fixture(scope="module")
def hf_gemma(gemma32, weights):
    """transformers' Gemma3ForCausalLM holding the engine's tensors (no copy but the norms)."""
    import transformers
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    cfg = gemma32.engine.model_config
    config = transformers.Gemma3TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, sliding_window=cfg.sliding_window,
        layer_types=["sliding_attention" if cfg.layer_window(i) else "full_attention" for i in range(cfg.num_layers)],
        query_pre_attn_scalar=cfg.head_dim, tie_word_embeddings=True, attn_implementation="sdpa",
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}})
    with torch.device("meta"):  # no random init of 268M parameters
        model = transformers.Gemma3ForCausalLM(config)
    state = {name: tensor - 1 if name.endswith("norm.weight") else tensor for name, tensor in weights.items()}
    state["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    # the buffers a state dict does not hold
    model.model.rotary_emb = Gemma3RotaryEmbedding(config)
    model.model.embed_tokens.embed_scale = torch.tensor(cfg.hidden_size ** 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def hf_prompt(hf_gemma, text_ids):
    """transformers over the 2,000-token prompt, once: its normed last hidden states [2000,
    hidden] (the first 1,500 rows are a 1,500-token run's: attention is causal) and its cache."""
    with torch.no_grad():
        out = hf_gemma.model(torch.tensor([text_ids]), use_cache=True)
    return out.last_hidden_state[0], out.past_key_values


def test_facts_come_from_the_gguf():
    cfg = read_model_config(MODEL)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("gemma3", 18, 640, 2048)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 1, 256, 262144)
    assert (cfg.sliding_window, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (512, 32768, True)
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert [i for i in range(18) if cfg.layer_window(i) is None] == [5, 11, 17]  # five local to one global


def test_logits_match_transformers_on_1500_tokens(gemma32, weights, hf_prompt, text_ids):
    """Every position's logits over a fixed sample of the vocabulary (the text's own tokens among
    them): a full 262,144-row head at 1,500 positions would take most of this file's time.
    Chunks of 512 put the window's edge across chunk boundaries."""
    ids = text_ids[:1500]
    cfg = gemma32.engine.model_config
    generator = torch.Generator().manual_seed(0)
    rows = torch.cat([torch.randperm(cfg.vocab_size, generator=generator)[:VOCAB_SAMPLE], torch.tensor(ids)]).unique()
    model = Gemma3Model(cfg, weights)  # the engine's weights, a head of those rows only
    model.lm_head = Projection(model.embed_tokens[rows])
    expected = hf_prompt[0][:1500] @ weights["model.embed_tokens.weight"][rows].T  # transformers' head, those rows
    for chunk in (1500, 512):
        ours = _chunked_logits(model, ids, chunk)
        diff = (ours - expected).abs().max().item()
        assert diff < LOGIT_TOLERANCE, f"chunk={chunk}: max |logit diff| = {diff}"
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    # a sane model too (a swapped norm or mixed-up rotary base reads as noise): the next token
    # is the sampled vocabulary's top logit at many positions
    hits = (rows[ours.argmax(-1)[:-1]] == torch.tensor(ids[1:])).float().mean().item()
    assert hits > 0.3, f"next token ranked first at {hits:.0%} of positions"


def test_greedy_past_the_window_matches_transformers(gemma32, hf_gemma, hf_prompt, text_ids):
    """2,000 tokens: local layers see 512 of them, global ones all; then the same prompt again
    from the prefix cache, beside a short prompt in one batch."""
    assert gemma32.engine.kv.local.num_groups == 5  # the hybrid pool, by default
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    output = gemma32.generate(text_ids, params, on_step=_checked)
    hidden, cache = hf_prompt
    expected = [int((hidden[-1] @ hf_gemma.lm_head.weight.T).argmax())]
    with torch.no_grad():  # transformers' greedy steps, on from its cache
        while len(expected) < 8:
            logits = hf_gemma(torch.tensor([[expected[-1]]]), past_key_values=cache, use_cache=True).logits
            expected.append(int(logits[0, -1].argmax()))
    assert output.token_ids == expected
    again = gemma32.generate([text_ids, text_ids[:40]], params, on_step=_checked)
    assert again[0].token_ids == expected
    assert again[0].stats.prefix_hit_tokens >= 1984
    # every layer keeping every block: the same tokens
    full_pool = _engine_on(gemma32, hybrid_kv=False)
    assert full_pool.engine.kv.local.num_groups == 0
    assert full_pool.generate(text_ids, params, on_step=_checked).token_ids == expected


def test_pauses_on_a_small_hybrid_pool(gemma32, text_ids):
    """Five requests whose decodes outgrow a 172-block pool (one sequence's local windows and 7
    blocks): sequences pause and resume, every step consistent, the tokens those of the same
    batch on a roomy pool."""
    prompts = [text_ids[i * 300:i * 300 + 40] for i in range(5)]
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    small = _engine_on(gemma32, kv_cache_memory=172 * 98304)  # fp32 blocks of 3 layers
    assert small.engine.kv.num_blocks == 172
    outputs = small.generate(prompts, params, on_step=_checked)
    assert sum(output.stats.pauses for output in outputs) > 0
    roomy = gemma32.generate(prompts, params, on_step=_checked)
    assert [output.token_ids for output in outputs] == [output.token_ids for output in roomy]


def test_branches_and_an_abort_past_the_window(gemma32, text_ids):
    """n=2 sampled branches sharing a 1,200-token prompt (its blocks copied on write), beside a
    request aborted mid-decode: the pool stays consistent at every step and is empty after."""
    engine = gemma32.engine
    kept = engine.add_request(text_ids[:1200], SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=0))
    aborted = engine.add_request(text_ids[500:1100], SamplingParams(max_tokens=50, temperature=0))
    finished, steps, abort_output = {}, 0, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        _checked(engine)
        steps += 1
        if steps == 4:
            abort_output = engine.abort_request(aborted)
    assert [len(branch.token_ids) for branch in finished[kept].outputs] == [6, 6]
    assert abort_output is not None and abort_output.finish_reason == "abort"


def _shared_local_pages(engine) -> int:
    """Local pages held by more than one sequence's table (in any group)."""
    holders: dict[int, int] = {}
    for tables in engine.kv.local.tables.values():
        for page in {page for table in tables for page in table if page >= 0}:
            holders[page] = holders.get(page, 0) + 1
    return sum(1 for count in holders.values() if count > 1)


BEAM_PROMPT, BEAM_PARAMS = 603, SamplingParams(max_tokens=8, beam_width=3)


@pytest.fixture(scope="module")
def beams_on_the_hybrid_pool(gemma32, text_ids):
    """Three beams over a 603-token prompt on the hybrid pool, every step checked: the beams fork
    on the local groups' pages while the window moves past the prompt's early blocks (each beam
    releases its share of them), and the decode crosses a block boundary at 608 tokens (the
    shared partial block copied in every group). Returns (output, the most local pages that more
    than one sequence held at a step)."""
    kv, shared = gemma32.engine.kv, [0]

    def _step(engine) -> None:
        _checked(engine)
        shared.append(_shared_local_pages(engine))

    assert kv.num_used_blocks == 0
    output = gemma32.generate(text_ids[:BEAM_PROMPT], BEAM_PARAMS, on_step=_step)
    assert kv.num_used_blocks == 0 and not kv.local.tables  # nothing leaked
    return output, max(shared)


def test_beam_search_past_the_window_on_the_hybrid_pool(gemma32, text_ids, beams_on_the_hybrid_pool):
    """The beams share local pages; their tokens are those of the pool in which every layer keeps
    every block."""
    hybrid, shared = beams_on_the_hybrid_pool
    assert shared > 0, "the beams never shared a local page"
    assert len(hybrid.token_ids) == BEAM_PARAMS.max_tokens and len(hybrid.outputs) == 1
    full_pool = _engine_on(gemma32, hybrid_kv=False)
    full = full_pool.generate(text_ids[:BEAM_PROMPT], BEAM_PARAMS, on_step=_checked)
    assert full_pool.engine.kv.num_used_blocks == 0
    assert hybrid.token_ids == full.token_ids


@pytest.mark.slow
def test_beam_search_past_the_window_matches_transformers(gemma32, hf_gemma, text_ids, beams_on_the_hybrid_pool):
    """The same beams as transformers' generate(num_beams=3) on the same weights."""
    ids = text_ids[:BEAM_PROMPT]
    with torch.no_grad():
        expected = hf_gemma.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=BEAM_PARAMS.max_tokens, num_beams=3, do_sample=False,
                                     pad_token_id=0, eos_token_id=sorted(gemma32.engine.eos_token_ids))
    assert beams_on_the_hybrid_pool[0].token_ids == expected[0, len(ids):].tolist()


def _tiny_gguf(path, drop_key: str | None = None) -> str:
    """A 1-layer Gemma 3 GGUF header with one F32 tensor (token_embd), minus `drop_key`."""
    import gguf
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in {"context_length": 64, "embedding_length": 8, "block_count": 1, "feed_forward_length": 16,
                       "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": 4,
                       "attention.value_length": 4, "attention.layer_norm_rms_epsilon": 1e-6,
                       "rope.freq_base": 1e6, "attention.sliding_window": 8}.items():
        if key != drop_key:
            add = writer.add_float32 if isinstance(value, float) else writer.add_uint32
            add(f"gemma3.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((32, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_tiny_header_reads(tmp_path):
    cfg = read_model_config(_tiny_gguf(tmp_path / "ok.gguf"))
    assert (cfg.vocab_size, cfg.sliding_window, cfg.local_layers) == (32, 8, (0,))


@pytest.mark.parametrize("key", ["attention.sliding_window", "attention.head_count_kv", "rope.freq_base"])
def test_gguf_missing_a_needed_key(tmp_path, key):
    with pytest.raises(ValueError, match=f"lacks gemma3.{key}"):
        read_model_config(_tiny_gguf(tmp_path / "m.gguf", drop_key=key))


def test_gguf_unknown_quant_type(tmp_path):
    path = _tiny_gguf(tmp_path / "q.gguf")
    data = bytearray(open(path, "rb").read())
    name = b"token_embd.weight"
    # tensor info: name, number of dims (u32), dims (u64 each), type (u32)
    at = data.rindex(name) + len(name)
    num_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * num_dims, 250)
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match="unknown quant type"):
        load_model(path)


def test_context_over_the_models_is_refused(gemma32):
    with pytest.raises(ValueError, match="exceeds the model's context.*32768"):
        LLM(model=MODEL, max_model_len=40000)
    with pytest.raises(ValueError):  # a prompt over 32K tokens
        gemma32.generate([2] * 32769, SamplingParams(max_tokens=1))


def test_need_layers_naming_a_sliding_window_layer_are_refused():
    with pytest.raises(ValueError, match=r"names sliding-window layers of gemma3 \(0, 4\).*name global layers"):
        LLM(model=MODEL, policy="replay", need_layers="0,4,5")


@pytest.mark.parametrize("policy", ["window", "sparse", "snapkv", "h2o", "quest"])
def test_lossy_policies_without_the_hybrid_pool_are_refused(policy):
    ratio = {"resident_ratio": 0.25} if policy in ("snapkv", "h2o", "quest") else {}
    with pytest.raises(ValueError, match="needs hybrid_kv=True.*read the global table by position"):
        LLM(model=MODEL, policy=policy, hybrid_kv=False, **ratio)


def test_layered_prefill_is_refused():
    with pytest.raises(ValueError, match="layered_prefill is not supported for gemma3"):
        LLM(model=MODEL, policy="window", layered_prefill=True)


def test_hf_config_of_gemma3_is_refused():
    with pytest.raises(ValueError, match="GGUF file only"):
        ModelConfig.from_hf_config({"model_type": "gemma3_text"})

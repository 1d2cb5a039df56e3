"""The Hugging Face directory loader on tiny random-weight checkpoints written by the test,
checked against transformers' own implementation of each architecture."""
from __future__ import annotations

import pytest
import torch

from kvreplay import LLM, SamplingParams

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)


def _write_checkpoint(path, arch: str, tokenizer):
    import transformers
    torch.manual_seed(0)
    vocab = len(tokenizer)
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, **TINY)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(vocab_size=vocab, tie_word_embeddings=True, **TINY)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.Qwen3Config(vocab_size=vocab, head_dim=16, tie_word_embeddings=True, **TINY)
        model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # random biases and norms, so that using them wrongly shows
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_directory_matches_transformers(tmp_path, arch, llm32):
    reference = _write_checkpoint(tmp_path, arch, llm32.tokenizer)
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="4MiB")
    cfg = llm.engine.model_config
    assert cfg.architecture == arch and cfg.num_layers == 2 and cfg.num_kv_heads == 2
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    prompt = llm.tokenizer("The quick brown fox jumps over the lazy dog").input_ids
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                       on_step=lambda e: e.check_integrity())
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      eos_token_id=None, pad_token_id=0)
    assert out.token_ids == expected[0, len(prompt):].tolist()


def test_directory_without_weights_is_a_clear_error(tmp_path, llm32):
    _write_checkpoint(tmp_path, "llama", llm32.tokenizer)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(model=str(tmp_path), dtype="float32")


@pytest.mark.slow
def test_gguf_tokenizer_takes_the_files_special_tokens(model_path, tmp_path, monkeypatch):
    """A fresh build (no cache) and its cached copy both stop where the file says: <|im_end|>."""
    from kvreplay.models.loader import _gguf_special_ids, load_tokenizer
    monkeypatch.setenv("KVREPLAY_CACHE_DIR", str(tmp_path))
    assert _gguf_special_ids(model_path) == {"bos": 1, "eos": 2}
    for _ in ("fresh", "cached"):
        tokenizer = load_tokenizer(None)
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
        assert tokenizer.eos_token == "<|im_end|>"


def test_file_special_tokens_correct_a_wrong_converter(llm32):
    """transformers 5.17 converts this file with eos <|im_start|>; the file's ids win, and an id
    the vocabulary lacks is ignored rather than set."""
    import copy

    from kvreplay.models.loader import use_file_special_tokens
    tokenizer = copy.deepcopy(llm32.tokenizer)
    tokenizer.eos_token = "<|im_start|>"
    assert tokenizer.eos_token_id == 1
    use_file_special_tokens(tokenizer, {"bos": 1, "eos": 2})
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    use_file_special_tokens(tokenizer, {"eos": len(tokenizer) + 5})
    assert tokenizer.eos_token_id == 2

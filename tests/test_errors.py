"""Bad inputs get clear errors and leave nothing behind."""
from __future__ import annotations

import json

import pytest

from kvreplay import LLM, EngineConfig, SamplingParams
from kvreplay.config import parse_bytes


def test_empty_prompt(llm32):
    with pytest.raises(ValueError, match="empty"):
        llm32.generate("", SamplingParams(max_tokens=4))
    llm32.engine.check_integrity()


def test_prompt_longer_than_context(llm32):
    with pytest.raises(ValueError, match="context"):
        llm32.generate([1] * 9000, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        llm32.generate([1] * 8000, SamplingParams(max_tokens=500))
    llm32.engine.check_integrity()


def test_bad_prompt_types_and_token_ids(llm32):
    with pytest.raises(TypeError):
        llm32.generate([3.5, 2], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="token ids"):
        llm32.generate([1, 10**7], SamplingParams(max_tokens=4))


def test_one_bad_prompt_in_a_batch_queues_nothing(llm32):
    with pytest.raises(ValueError):
        llm32.generate(["fine prompt", ""], SamplingParams(max_tokens=4))
    assert not llm32.engine.has_unfinished_requests()
    llm32.engine.check_integrity()


def test_kv_cache_too_small_for_one_request():
    llm = LLM(dtype="float32", kv_cache_memory="1MiB")  # 22 tokens at fp32
    with pytest.raises(ValueError, match="kv_cache_memory=.*raise kv_cache_memory"):
        llm.generate("x " * 40, SamplingParams(max_tokens=8))
    llm.engine.check_integrity()
    with pytest.raises(ValueError, match="holds no block"):
        LLM(dtype="float32", kv_cache_memory="10KiB")


def test_unknown_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model="/nonexistent/model.gguf")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*llama"):
        LLM(model=str(tmp_path))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        LLM(model=str(path))


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_cache_memory": "-5MiB"}, "cannot parse"),
    ({"kv_cache_memory": "lots"}, "cannot parse"),
    ({"kv_cache_memory": 0}, "positive"),
    ({"dtype": "int3"}, "dtype"),
    ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": -1}, "max_num_seqs"),
    ({"policy": "magic"}, "unknown policy"),
    ({"device": "tpu"}, "device"),
])
def test_bad_engine_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_device_follows_the_environment_and_a_bad_one_is_a_clear_error(monkeypatch):
    import torch
    monkeypatch.setenv("KVREPLAY_DEVICE", "tpu")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda"):
        EngineConfig()
    assert EngineConfig(device="cpu").device == "cpu"  # an explicit device wins
    monkeypatch.setenv("KVREPLAY_DEVICE", "cuda")
    if torch.cuda.is_available():
        assert EngineConfig().device == "cuda"
    else:
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            EngineConfig()
    monkeypatch.delenv("KVREPLAY_DEVICE")
    assert EngineConfig().device == "cpu"


def test_attention_backend_choices_and_refusals(monkeypatch):
    """auto picks triton only on a GPU; triton on a CPU needs the interpreter, and triton at all
    needs the package: each refusal says what to do."""
    from kvreplay.kernels import triton_backend
    with pytest.raises(ValueError, match="unknown attention_backend 'cuda'"):
        EngineConfig(attention_backend="cuda")
    assert not EngineConfig(device="cpu").use_triton  # auto on a CPU: torch
    assert not EngineConfig(device="cpu", attention_backend="torch").use_triton
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_backend, "triton_available", lambda: True)
    assert triton_backend.use_triton("auto", "cuda") and not triton_backend.use_triton("torch", "cuda")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        EngineConfig(device="cpu", attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineConfig(device="cpu", attention_backend="triton").use_triton
    monkeypatch.setattr(triton_backend, "triton_available", lambda: False)
    assert not triton_backend.use_triton("auto", "cuda")
    with pytest.raises(ValueError, match="needs the triton package"):
        EngineConfig(device="cpu", attention_backend="triton")


def test_unknown_llm_keyword():
    with pytest.raises(TypeError, match="unknown LLM option"):
        LLM(kv_cache_mem="1GiB")


def test_parse_bytes_units():
    assert parse_bytes("256MiB") == 256 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes(4096) == 4096
    assert parse_bytes("1.5KiB") == 1536


def test_abort_frees_blocks(llm32):
    engine = llm32.engine
    request_id = engine.add_request("Tell me a long story about a dragon.", SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    assert engine.kv.num_used_blocks > 0
    output = engine.abort_request(request_id)
    assert output.finish_reason == "abort"
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.abort_request(request_id) is None  # unknown ids are ignored

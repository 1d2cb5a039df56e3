"""Shared fixtures: the real default model (fp32 for exactness) and its transformers reference."""
from __future__ import annotations

import os

import pytest
import torch



def _test_threads() -> int:
    """Threads for this test process: KVREPLAY_TEST_THREADS=N (bench/gpu_check.sh), else up to 2
    cores (this project's CI machine) shared among pytest-xdist's workers (`make test` runs two,
    one thread each: most tests are short real-model runs whose Python and startup time then
    overlap; tests that are about thread counts set theirs)."""
    if os.environ.get("KVREPLAY_TEST_THREADS"):
        return int(os.environ["KVREPLAY_TEST_THREADS"])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return max(1, min(2, os.cpu_count() or 1) // workers)


torch.set_num_threads(_test_threads())


@pytest.fixture(scope="session")
def model_path() -> str:
    from kvreplay.models.loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def llm32():
    """The default model in fp32 with a roomy pool; tests must leave it idle."""
    from kvreplay import LLM
    llm = LLM(dtype="float32", kv_cache_memory="192MiB", max_num_batched_tokens=512)
    yield llm
    llm.engine.check_integrity()


@pytest.fixture(scope="session")
def hf_reference(model_path):
    """transformers' own Llama on the same GGUF weights: the independent reference."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path),
                                                 gguf_file=os.path.basename(model_path),
                                                 dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def real_text() -> str:
    """Long real English text: the Python reference docs shipped with CPython."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer random Llama (2 KV heads of 16) with the default model's tokenizer: engine logic
    on real code paths at a small cost."""
    import transformers
    from kvreplay.models.loader import load_tokenizer
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = load_tokenizer(None)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # sharper attention than the init's, so that what is kept matters
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


# Gemma 3 270M (tests/test_gemma3*.py): one fp32 engine for the session, loaded once.
@pytest.fixture(scope="session")
def gemma32():
    """The engine on Gemma 3 in fp32; tests leave it idle."""
    from kvreplay import LLM
    llm = LLM(model="gemma3-270m", dtype="float32", kv_cache_memory="128MiB", max_num_batched_tokens=512)
    yield llm
    llm.engine.check_integrity()


@pytest.fixture(scope="session")
def text_ids(gemma32, real_text):
    ids = gemma32.tokenizer(real_text[:40000]).input_ids[:2000]
    assert len(ids) == 2000
    return ids

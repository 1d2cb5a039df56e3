"""Shared fixtures: the real default model (fp32 for exactness) and its transformers reference."""
from __future__ import annotations

import os

import pytest
import torch

# 2 threads (this project's CI machine); KVREPLAY_TEST_THREADS=N for a bigger one (bench/gpu_check.sh).
torch.set_num_threads(int(os.environ.get("KVREPLAY_TEST_THREADS") or 0) or max(1, min(2, os.cpu_count() or 1)))


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

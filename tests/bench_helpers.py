"""One small fp32 engine shared by the bench tests (a model load costs ~8 s here)."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def shared_llm():
    """fp32 (exact), 32 MiB of KV = 45 blocks = 720 tokens. Tests must leave it idle."""
    from kvreplay import LLM
    return LLM(dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=256)


@functools.lru_cache(maxsize=1)
def shared_corpus() -> tuple[int, ...]:
    from kvreplay.bench.workload import corpus_token_ids
    return tuple(corpus_token_ids(shared_llm().tokenizer))

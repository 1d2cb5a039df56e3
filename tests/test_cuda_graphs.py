"""Decode steps from CUDA graphs (kvreplay/engine/cuda_graphs.py).

On the CPU the padded step runs without capturing (capture=False): rows padded to a power of two by
copies of row 0 and tables padded with masked blocks must give the eager step's tokens. On a GPU
(KVREPLAY_DEVICE=cuda) the engine replays real graphs and must give the eager engine's tokens."""
from __future__ import annotations

import logging

import pytest
import torch

from kvreplay import LLM, SamplingParams
from kvreplay.engine.cuda_graphs import MIN_BLOCKS, DecodeGraphs, bucket, cuda_graphs_enabled

# lengths chosen so that 3 rows pad to 4 and the tables cross MIN_BLOCKS (16-token blocks)
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a",
           "def fibonacci(n):\n    " + "# compute the n-th Fibonacci number\n    " * 11]  # 117 tokens
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_bucket_rounds_up_to_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 31, 32, 33)] == [1, 2, 4, 4, 8, 32, 32, 64]
    assert bucket(3, MIN_BLOCKS) == MIN_BLOCKS and bucket(9, MIN_BLOCKS) == 16


def test_switch_parses_the_environment(monkeypatch):
    monkeypatch.setenv("KVREPLAY_CUDA_GRAPHS", "0")
    assert not cuda_graphs_enabled()
    monkeypatch.setenv("KVREPLAY_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match="KVREPLAY_CUDA_GRAPHS must be 0 or 1"):
        cuda_graphs_enabled()


@pytest.fixture(scope="module")
def cpu_llm():
    llm = LLM(dtype="float32", device="cpu", kv_cache_memory="32MiB")
    yield llm
    llm.engine.check_integrity()


@pytest.fixture(scope="module")
def eager_tokens(cpu_llm):
    return _generate(cpu_llm)


def _generate(llm):
    outputs = llm.generate(PROMPTS, PARAMS, on_step=lambda e: e.check_integrity())
    return [o.token_ids for o in outputs]


@pytest.mark.slow
def test_padded_step_gives_the_eager_tokens(cpu_llm, eager_tokens):
    runner = cpu_llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv.kv_caches, runner.kv.block_size, capture=False)
    try:
        padded = _generate(cpu_llm)
        used = set(runner.graphs.buckets)
    finally:
        runner.graphs = None
    assert padded == eager_tokens
    # the 3-row steps ran as 4 rows; the long prompt's table crossed from 8 to 16 blocks
    assert (4, MIN_BLOCKS) in used and (4, 2 * MIN_BLOCKS) in used, used


def _staggered(engine) -> tuple[list[list[int]], list[bool]]:
    """Two requests, the second added after five steps; every step checked. Returns the tokens of
    each and, per step of the first twelve, whether it went to the graphs (runner.graphs.calls)."""
    runner, kinds, finished = engine.runner, [], {}
    ids = [engine.add_request(PROMPTS[0], PARAMS)]
    step = 0
    while engine.has_unfinished_requests():
        if step == 5:
            ids.append(engine.add_request(PROMPTS[1], PARAMS))
        before = len(getattr(runner.graphs, "calls", []))
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        engine.check_integrity()
        if step < 12:
            kinds.append(len(getattr(runner.graphs, "calls", [])) > before)
        step += 1
    return [finished[i] for i in ids], kinds


@pytest.mark.slow
def test_only_plain_decode_steps_take_the_graphs(cpu_llm):
    """A step that also prefills a new request runs eagerly; the decode-only steps around it take
    the graphs; the tokens are the eager engine's."""
    engine, runner = cpu_llm.engine, cpu_llm.engine.runner
    eager, _ = _staggered(engine)
    graphs = runner.graphs = DecodeGraphs(runner.model, runner.kv.kv_caches, runner.kv.block_size, capture=False)
    graphs.calls, run = [], graphs.run
    graphs.run = lambda *args: graphs.calls.append(len(args[0])) or run(*args)
    try:
        graphed, kinds = _staggered(engine)
    finally:
        runner.graphs = None
    # step 0 prefills, 1-4 decode one row, 5 prefills the second prompt beside a decode, then two rows
    assert kinds == [False, True, True, True, True, False] + [True] * 6, kinds
    assert graphs.calls[:5] == [1, 1, 1, 1, 2]
    assert graphed == eager


@pytest.mark.slow
def test_failed_capture_falls_back_to_eager(cpu_llm, eager_tokens, caplog):
    """Capturing needs a CUDA model: for a CPU one it fails (also where a GPU is present), which
    must leave the eager step (same tokens, a warning, no leaked blocks) rather than an error."""
    runner = cpu_llm.engine.runner
    graphs = runner.graphs = DecodeGraphs(runner.model, runner.kv.kv_caches, runner.kv.block_size)
    try:
        with caplog.at_level(logging.WARNING, logger="kvreplay.engine.cuda_graphs"):
            fallen_back = _generate(cpu_llm)
    finally:
        runner.graphs = None
    assert fallen_back == eager_tokens
    assert graphs.failed is not None and graphs.replays == 0 and not graphs.buckets
    assert "CUDA graph capture failed" in caplog.text and "need a model on a CUDA device" in graphs.failed


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphs_on_gpu_give_the_eager_tokens(monkeypatch):
    llm = LLM(dtype="float32", device="cuda", kv_cache_memory="64MiB")
    runner = llm.engine.runner
    assert runner.graphs is not None
    graphed = _generate(llm)
    assert runner.graphs.failed is None, runner.graphs.failed
    assert runner.graphs.replays > 0
    runner.graphs = None
    eager = _generate(llm)
    llm.engine.check_integrity()
    assert graphed == eager

"""Peers run on the same requests, model file and machine, reported as ratios (docs/architecture.md §8).

- `transformers`: `generate` one request at a time (it has no scheduler), greedy, EOS ignored;
  a streamer stamps every token, so TTFT/TPOT/E2E use the same formulas as ours.
- `transformers-batch`: transformers' continuous-batching `generate_batch` over all requests at
  once; it returns only when all are done, so only throughput is measured.
- `llama-cpp`: llama.cpp through `llama-cpp-python` on the same GGUF, streamed one request at a
  time. Optional: not installable in this project's environment so far (no wheel, and building
  it compiles llama.cpp), so this runner has not been exercised here.

A peer that is not installed, or fails, is reported with its status instead of a number.
"""
from __future__ import annotations

import os
import time

from kvreplay.bench.metrics import RequestRecord, compute_metrics
from kvreplay.bench.workload import BenchRequest


def _one_at_a_time(generate, timed: list[BenchRequest], warmup: list[BenchRequest], progress: bool,
                   note: str) -> dict:
    """Serve requests in arrival order, one at a time; `generate(request, record, start)` stamps
    each token into `record` (None while warming up)."""
    from tqdm import tqdm
    for request in warmup:
        generate(request, None, time.perf_counter())
    records = [RequestRecord(r.index, r.arrival_s, r.num_prompt_tokens) for r in timed]
    start = time.perf_counter()
    for request, record in tqdm(list(zip(timed, records)), desc="peer", unit="req",
                                disable=not progress, leave=False):
        time.sleep(max(0.0, request.arrival_s - (time.perf_counter() - start)))
        generate(request, record, start)
    metrics = compute_metrics(records)
    return {"output_token_throughput": metrics["output_token_throughput"],
            "e2e_mean_ms": metrics["e2e_ms"]["mean"], "metrics": metrics, "note": note}


def _hf_model(config):
    import torch
    from transformers import AutoModelForCausalLM
    from kvreplay.models.loader import resolve_model_path
    path = resolve_model_path(config.model)
    if os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=config.torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=config.torch_dtype)
    model.eval()
    return model, torch


def _transformers(config, timed: list[BenchRequest], warmup: list[BenchRequest], progress: bool) -> dict:
    from transformers.generation.streamers import BaseStreamer
    model, torch = _hf_model(config)

    class Stamps(BaseStreamer):
        def __init__(self, record: RequestRecord | None, start: float):
            self.record, self.start, self.seen_prompt = record, start, False

        def put(self, value):
            if not self.seen_prompt:   # generate hands over the prompt first
                self.seen_prompt = True
            elif self.record is not None:
                self.record.token_times_s.append(time.perf_counter() - self.start)

        def end(self):
            pass

    def generate(request: BenchRequest, record: RequestRecord | None, start: float):
        ids = torch.tensor([request.prompt_token_ids])
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=request.max_tokens,
                           min_new_tokens=request.max_tokens, do_sample=False, pad_token_id=0,
                           streamer=Stamps(record, start))

    return _one_at_a_time(generate, timed, warmup, progress, "generate, one request at a time")


def _transformers_batch(config, timed, warmup, progress) -> dict:
    from transformers import GenerationConfig
    model, torch = _hf_model(config)
    longest = max(r.max_tokens for r in timed)
    generation = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                                  eos_token_id=-1, pad_token_id=0)
    if warmup:
        model.generate_batch(inputs=[r.prompt_token_ids for r in warmup], generation_config=generation)
    start = time.perf_counter()
    with torch.no_grad():
        results = model.generate_batch(inputs=[r.prompt_token_ids for r in timed], generation_config=generation)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(getattr(r, "generated_tokens", r)) for r in results.values())
    return {"output_token_throughput": output_tokens / elapsed, "e2e_mean_ms": None,
            "note": f"generate_batch, all {len(timed)} at once, {output_tokens} tokens in {elapsed:.1f} s "
                    "(arrival times ignored)"}


def _llama_cpp(config, timed, warmup, progress) -> dict:
    from llama_cpp import Llama
    from kvreplay.models.loader import resolve_model_path
    path = resolve_model_path(config.model)
    longest = max(r.num_prompt_tokens + r.max_tokens for r in timed)
    llm = Llama(model_path=path, n_ctx=longest + 16, n_threads=os.cpu_count(), verbose=False)

    def generate(request: BenchRequest, record: RequestRecord | None, start: float):
        llm.reset()
        for _ in llm.create_completion(request.prompt_token_ids, max_tokens=request.max_tokens,
                                       temperature=0.0, stream=True, logit_bias={llm.token_eos(): -1e9}):
            if record is not None:
                record.token_times_s.append(time.perf_counter() - start)

    return _one_at_a_time(generate, timed, warmup, progress, "one request at a time")


PEERS = {"transformers": _transformers, "transformers-batch": _transformers_batch, "llama-cpp": _llama_cpp}


def run_serve_peer(name: str, config, timed: list[BenchRequest], warmup: list[BenchRequest],
                   ours_output_tok_s: float | None, progress: bool = True) -> dict:
    """One peer on the same requests; `throughput_ratio` = ours / peer output tokens per second."""
    if name not in PEERS:
        return {"label": name, "status": "unknown peer", "note": f"known: {', '.join(PEERS)}"}
    try:
        result = PEERS[name](config, timed, warmup, progress)
    except ImportError as exc:
        return {"label": name, "status": "not installed", "note": str(exc)}
    except Exception as exc:  # a peer's own failure must not lose our results
        return {"label": name, "status": "failed", "note": f"{type(exc).__name__}: {exc}"}
    peer = result["output_token_throughput"]
    result.update(label=name, status="ok",
                  throughput_ratio=ours_output_tok_s / peer if ours_output_tok_s and peer else None)
    return result

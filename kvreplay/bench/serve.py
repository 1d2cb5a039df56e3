"""`bench serve`: replay a workload against the engine in-process, or a server by URL.

In-process, arrivals are simulated on the wall clock: a request is added once its arrival time
has passed, and the engine steps whenever it has work. A request's latency runs from its
scheduled arrival, so time spent waiting for the current step counts as queueing, as it would in
a server. Each step returns the requests that produced a token; every new token gets that step's
time stamp.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from kvreplay.bench.metrics import RequestRecord, compute_metrics
from kvreplay.bench.workload import BenchRequest


@dataclass
class ServeRun:
    """One policy's (or one server's) timed run."""
    label: str
    records: list[RequestRecord]
    kv: dict = field(default_factory=dict)        # block size, capacity, peak bytes per tier, ...
    engine: dict = field(default_factory=dict)    # engine counters (in-process only)

    @property
    def metrics(self) -> dict:
        return compute_metrics(self.records)

    def as_dict(self) -> dict:
        return {"label": self.label, "metrics": self.metrics, "kv": self.kv, "engine": self.engine,
                "requests": [{"index": r.index, "arrival_s": r.arrival_s, "prompt_tokens": r.num_prompt_tokens,
                              "output_tokens": r.num_output_tokens, "error": r.error,
                              "ttft_s": r.ttft_s if r.ok else None, "e2e_s": r.e2e_s if r.ok else None,
                              "stats": r.stats} for r in self.records]}


def _params(request: BenchRequest):
    from kvreplay.sampling import SamplingParams
    return SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)


def kv_tier_peaks(engine, peak_blocks: int) -> dict[str, int]:
    """Peak resident KV bytes per tier. The engine has a hot tier today; a tiered KV manager
    reports the others through `peak_bytes_by_tier()` ({"cold": ..., "index": ...})."""
    peaks = {"hot": peak_blocks * engine.kv.block_size * engine.kv_bytes_per_token}
    by_tier = getattr(engine.kv, "peak_bytes_by_tier", None)
    if callable(by_tier):
        peaks.update(by_tier())
    return peaks


def _drain(engine, requests: list[BenchRequest]) -> None:
    for request in requests:
        engine.add_request(request.prompt_token_ids, _params(request))
    while engine.has_unfinished_requests():
        engine.step()


def run_in_process(engine, requests: list[BenchRequest], warmup: list[BenchRequest] = (),
                   label: str = "kvreplay", progress: bool = True, on_step=None,
                   clock=time.perf_counter, kv_map=None) -> ServeRun:
    """Run `warmup` untimed, then `requests` at their arrival times. `engine` must be idle.
    `kv_map` (a bench.kv_map.KVMapRecorder) records the KV map after the timed steps."""
    from tqdm import tqdm
    assert not engine.has_unfinished_requests(), "the engine must be idle before a bench run"
    _drain(engine, list(warmup))
    warm_peak = engine.kv.peak_used_blocks
    counters_before = dict(vars(engine.counters))
    records = {r.index: RequestRecord(r.index, r.arrival_s, r.num_prompt_tokens) for r in requests}
    queue = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    index_of: dict[str, int] = {}
    observed_peak = usage_sum = steps = 0
    bar = tqdm(total=len(requests), desc=f"serve {label}", unit="req", disable=not progress, leave=False)
    start = clock()
    try:
        while queue or engine.has_unfinished_requests():
            now = clock() - start
            while queue and queue[0].arrival_s <= now:
                request = queue.pop(0)
                try:
                    request_id = engine.add_request(request.prompt_token_ids, _params(request),
                                                    request_id=f"bench-{request.index}", stream=True)
                    index_of[request_id] = request.index
                except ValueError as exc:  # e.g. longer than the KV budget can ever hold
                    records[request.index].error = str(exc)
                    bar.update(1)
            if not engine.has_unfinished_requests():
                if queue:
                    time.sleep(max(0.0, queue[0].arrival_s - (clock() - start)))
                continue
            outputs = engine.step()
            stamp = clock() - start
            for output in outputs:
                record = records[index_of[output.request_id]]
                record.token_times_s += [stamp] * (len(output.token_ids) - record.num_output_tokens)
                if output.finished:
                    record.stats = output.stats.as_dict()
                    bar.update(1)
            used = engine.kv.num_used_blocks
            observed_peak = max(observed_peak, used)
            usage_sum += used
            steps += 1
            if on_step is not None:
                on_step(engine)
            if kv_map is not None:
                kv_map.record(engine, outputs, stamp)
        if kv_map is not None:  # the end: every request answered, the totals final
            kv_map.record(engine, [], clock() - start, force=True)
    finally:
        bar.close()
        for request_id in list(index_of):  # an error or Ctrl-C leaves no request behind
            engine.abort_request(request_id)
    # The engine's own peak also sees blocks freed within a step; it is ours once past warmup's.
    peak = engine.kv.peak_used_blocks if engine.kv.peak_used_blocks > warm_peak else observed_peak
    block_bytes = engine.kv.block_size * engine.kv_bytes_per_token
    kv = {"block_size": engine.kv.block_size, "bytes_per_token": engine.kv_bytes_per_token,
          "capacity_bytes": engine.kv.num_blocks * block_bytes, "peak_bytes": kv_tier_peaks(engine, peak),
          "mean_used_bytes": usage_sum / steps * block_bytes if steps else 0.0}
    counters = {k: v - counters_before.get(k, 0) for k, v in vars(engine.counters).items()}
    return ServeRun(label, [records[r.index] for r in requests], kv, counters)


# ---------------------------------------------------------------- against a server

def _post_stream(url: str, body: dict, timeout_s: float):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout_s)


def server_model(base_url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=timeout_s) as response:
        models = json.load(response).get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]


def run_against_url(base_url: str, requests: list[BenchRequest], warmup: list[BenchRequest] = (),
                    model: str | None = None, label: str | None = None, progress: bool = True,
                    timeout_s: float = 600.0, clock=time.perf_counter) -> ServeRun:
    """Stream `/v1/completions` (token-id prompts, greedy, `ignore_eos`) from one thread per
    request. One SSE chunk with a choice counts as one token, as the kvreplay server and vLLM
    send them for n=1; the per-request KV counters come from the final `usage.kv`."""
    from tqdm import tqdm
    base_url = base_url.rstrip("/")
    model = model or server_model(base_url)
    endpoint = base_url + "/v1/completions"

    def send(request: BenchRequest, record: RequestRecord | None, start: float, bar=None):
        if record is not None:
            time.sleep(max(0.0, request.arrival_s - (clock() - start)))
        body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.max_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        try:
            with _post_stream(endpoint, body, timeout_s) as response:
                for raw in response:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    chunk = json.loads(payload)
                    if record is None:
                        continue
                    if chunk.get("choices"):
                        record.token_times_s.append(clock() - start)
                    usage = chunk.get("usage") or {}
                    if usage.get("kv"):
                        record.stats = dict(usage["kv"])
        except Exception as exc:  # any transport or server error is this request's failure
            if record is None:
                raise
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            if bar is not None:
                bar.update(1)

    for request in warmup:
        send(request, None, clock())
    records = [RequestRecord(r.index, r.arrival_s, r.num_prompt_tokens) for r in requests]
    bar = tqdm(total=len(requests), desc=f"serve {base_url}", unit="req", disable=not progress, leave=False)
    start = clock()
    threads = [threading.Thread(target=send, args=(r, rec, start, bar), daemon=True)
               for r, rec in zip(requests, records)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    bar.close()
    return ServeRun(label or base_url, records, {"model": model})

"""The serving bench: workload statistics, metric formulas, and smoke runs (in-process and URL)."""
from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from kvreplay.bench.metrics import RequestRecord, compute_metrics, summarize
from kvreplay.bench.serve import run_against_url, run_in_process
from kvreplay.bench.workload import WorkloadSpec, arrival_times, make_workload, sample_buckets_and_lengths
from bench_helpers import shared_corpus, shared_llm


# ---------------------------------------------------------------- workload

def test_length_mix_within_tolerance_for_a_seed():
    spec = WorkloadSpec(num_requests=4000, seed=7)
    buckets, lengths = sample_buckets_and_lengths(spec)
    fractions = np.bincount(buckets, minlength=3) / len(buckets)
    assert np.allclose(fractions, [0.7, 0.2, 0.1], atol=0.02), fractions
    for b, (lo, hi) in enumerate(spec.buckets):
        chosen = lengths[buckets == b]
        assert chosen.min() >= lo and chosen.max() < hi
        assert abs(chosen.mean() - (lo + hi - 1) / 2) < 0.05 * (hi - lo)  # uniform within a bucket
    assert spec.buckets == [(64, 1024), (1024, 4096), (4096, 7680)]
    again, _ = sample_buckets_and_lengths(spec)
    assert np.array_equal(buckets, again)                        # seeded
    other, _ = sample_buckets_and_lengths(WorkloadSpec(num_requests=4000, seed=8))
    assert not np.array_equal(buckets, other)


def test_poisson_and_burst_arrivals():
    spec = WorkloadSpec(num_requests=5000, request_rate=4.0, seed=3)
    times = arrival_times(spec)
    gaps = np.diff(times)
    assert times[0] == 0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 0.25) < 0.25 * 0.05                 # mean gap 1/rate
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05               # exponential: CV = 1
    assert np.all(arrival_times(WorkloadSpec(num_requests=10)) == 0)  # burst
    # the rate does not change the prompts
    a, _ = sample_buckets_and_lengths(spec)
    b, _ = sample_buckets_and_lengths(WorkloadSpec(num_requests=5000, request_rate=math.inf, seed=3))
    assert np.array_equal(a, b)


def test_make_workload_scales_and_checks_context():
    corpus = list(range(5000))
    spec = WorkloadSpec(num_requests=50, length_scale=0.125, output_tokens=16, num_warmup=2)
    assert spec.buckets == [(8, 128), (128, 512), (512, 960)]
    warmup, timed = make_workload(spec, corpus, max_model_len=1024)
    assert len(warmup) == 2 and len(timed) == 50
    for request in timed:
        lo, hi = spec.buckets[request.bucket]
        assert lo <= request.num_prompt_tokens < hi and request.max_tokens == 16
        first = request.prompt_token_ids[0]
        assert request.prompt_token_ids == corpus[first:first + request.num_prompt_tokens]
    with pytest.raises(ValueError, match="lower --length-scale"):
        make_workload(WorkloadSpec(num_requests=5), list(range(10_000)), max_model_len=2048)
    with pytest.raises(ValueError, match="sum to 1"):
        WorkloadSpec(mix=((0.5, 1, 10),))


# ---------------------------------------------------------------- metrics

def test_metric_formulas_on_synthetic_timestamps():
    a = RequestRecord(0, arrival_s=0.0, num_prompt_tokens=10, token_times_s=[0.5, 0.7, 1.0, 1.1])
    b = RequestRecord(1, arrival_s=1.0, num_prompt_tokens=20, token_times_s=[1.2, 2.0],
                      stats={"pauses": 1, "replays": 2, "replayed_tokens": 64})
    c = RequestRecord(2, arrival_s=1.5, num_prompt_tokens=5, token_times_s=[3.0])   # N=1: no TPOT
    failed = RequestRecord(3, arrival_s=0.2, num_prompt_tokens=7, error="too long")
    assert a.ttft_s == 0.5 and a.e2e_s == 1.1
    assert a.tpot_s == pytest.approx((1.1 - 0.5) / 3)
    assert a.itls_s == pytest.approx([0.2, 0.3, 0.1])
    assert b.tpot_s == pytest.approx(0.8) and c.tpot_s is None
    m = compute_metrics([a, b, c, failed])
    assert (m["num_requests"], m["num_completed"], m["num_failed"]) == (4, 3, 1)
    assert m["duration_s"] == pytest.approx(3.0)                  # first arrival 0 -> last token 3.0
    assert m["output_tokens"] == 7 and m["prompt_tokens"] == 35
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_token_throughput"] == pytest.approx(7 / 3)
    assert m["total_token_throughput"] == pytest.approx(42 / 3)
    assert m["ttft_ms"]["mean"] == pytest.approx(1000 * (0.5 + 0.2 + 1.5) / 3)
    assert m["ttft_ms"]["p50"] == pytest.approx(500)
    assert m["tpot_ms"]["mean"] == pytest.approx(1000 * (0.2 + 0.8) / 2)
    assert m["itl_ms"]["p50"] == pytest.approx(250)              # gaps 0.1 0.2 0.3 0.8
    assert m["e2e_ms"]["p99"] == pytest.approx(1000 * (1.1 + 0.98 * 0.4))   # e2e 1.0 1.1 1.5
    assert m["counters"]["pauses"] == 1 and m["counters"]["replayed_tokens"] == 64
    assert summarize([]) == {"mean": None, "p50": None, "p99": None}


# ---------------------------------------------------------------- smoke runs

@pytest.fixture(scope="module")
def small_llm():
    return shared_llm()


def test_in_process_smoke_under_a_tiny_budget(small_llm):
    engine = small_llm.engine
    corpus = list(shared_corpus())
    # 9 requests of up to 153 + 4 tokens on a 720-token pool: they queue, and some are preempted
    spec = WorkloadSpec(num_requests=9, request_rate=50.0, seed=1, length_scale=0.02, output_tokens=4,
                        num_warmup=1)
    warmup, timed = make_workload(spec, corpus, engine.max_model_len)
    run = run_in_process(engine, timed, warmup, label="full", progress=False,
                         on_step=lambda e: e.check_integrity())
    m = run.metrics
    assert m["num_completed"] == 9 and m["output_tokens"] == 36
    assert all(r.num_output_tokens == 4 and r.ttft_s > 0 for r in run.records)
    assert run.kv["peak_bytes"]["hot"] > 0
    assert run.kv["peak_bytes"]["hot"] <= run.kv["capacity_bytes"]
    assert run.engine["generation_tokens"] == 36
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


class _FakeServer(BaseHTTPRequestHandler):
    """An OpenAI-style streaming endpoint: one chunk per token, then usage with KV counters."""
    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(json.dumps({"data": [{"id": "fake-model"}]}).encode(), "application/json")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["model"] == "fake-model" and body["stream"] and body["ignore_eos"]
        chunks = [{"choices": [{"text": "x", "index": 0}]} for _ in range(body["max_tokens"])]
        chunks.append({"choices": [], "usage": {"completion_tokens": body["max_tokens"],
                                                "kv": {"replays": 1, "pauses": 0}}})
        payload = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
        self._send(payload, "text/event-stream")

    def _send(self, payload: bytes, kind: str):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def test_against_a_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        spec = WorkloadSpec(num_requests=4, request_rate=100.0, length_scale=0.01, output_tokens=3, num_warmup=1)
        warmup, timed = make_workload(spec, list(range(1000)))
        run = run_against_url(f"http://127.0.0.1:{server.server_port}", timed, warmup, progress=False)
    finally:
        server.shutdown()
    m = run.metrics
    assert m["num_completed"] == 4 and m["output_tokens"] == 12
    assert m["counters"]["replays"] == 4 and run.kv["model"] == "fake-model"


def test_cli_smoke(tmp_path, capsys):
    from kvreplay.cli import main
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--num-requests", "3", "--length-scale", "0.02", "--output-tokens", "3",
                 "--num-warmup", "0", "--kv-cache-memory", "2MiB", "--dtype", "float32",
                 "--no-progress", "--json", str(out)]) == 0
    assert "| full | 3/3 |" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["runs"][0]["metrics"]["output_tokens"] == 9
    assert result["workload"]["request_rate"] == "inf"
    assert main(["bench", "serve", "--policies", "full,nonsense", "--no-progress"]) == 2

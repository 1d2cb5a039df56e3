"""Peers (the transformers one runs; others report their status) and the plots."""
from __future__ import annotations

import importlib.util

import pytest

from kvreplay.bench.peers import run_serve_peer
from kvreplay.bench.workload import BenchRequest
from kvreplay.config import EngineConfig

REQUESTS = [BenchRequest(0, 0.0, [1000 + i for i in range(12)], 2, 0),
            BenchRequest(1, 0.0, [2000 + i for i in range(20)], 2, 0)]


@pytest.mark.slow
def test_transformers_peer_runs_the_same_requests():
    result = run_serve_peer("transformers", EngineConfig(dtype="float32"), REQUESTS, [], 10.0, progress=False)
    assert result["status"] == "ok", result
    assert result["metrics"]["output_tokens"] == 4 and result["metrics"]["num_completed"] == 2
    assert result["throughput_ratio"] == pytest.approx(10.0 / result["output_token_throughput"])


def test_missing_and_unknown_peers_are_reported():
    assert run_serve_peer("nonsense", EngineConfig(), REQUESTS, [], 1.0)["status"] == "unknown peer"
    if importlib.util.find_spec("llama_cpp") is None:
        assert run_serve_peer("llama-cpp", EngineConfig(), REQUESTS, [], 1.0)["status"] == "not installed"


def _serve_run(policy, capacity_mib, tput):
    stats = {"mean": 1.0, "p50": 1.0, "p99": 2.0}
    return {"label": policy, "policy": policy, "kv": {"capacity_bytes": capacity_mib * 2**20},
            "metrics": {"output_token_throughput": tput, "ttft_ms": stats,
                        "counters": {"pauses": 0, "preemptions": 3 if capacity_mib < 16 else 0}}}


def test_plots_render(tmp_path):
    pytest.importorskip("matplotlib")
    from kvreplay.bench import plots
    serve = {"runs": [_serve_run("full", mib, t) for mib, t in ((8, 5.0), (16, 9.0), (32, 10.0))],
             "workload": {"num_requests": 3}, "environment": {"command": "kvreplay bench serve ..."}}
    plots.throughput_vs_budget([serve, serve], str(tmp_path / "t.png"))
    quality = {"runs": [{"policy": "full", "budget_bytes": b * 2**20, "memory_ratio": {"1024": b / 24},
                         "retrieval": {"grid": {"1024": {"0.5": float(b >= 24)}}},
                         "fidelity": {"top1_agreement": 1.0 if b >= 24 else None}} for b in (16, 32)]}
    plots.memory_vs_quality(quality, str(tmp_path / "q.png"))
    for name in ("t.png", "q.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

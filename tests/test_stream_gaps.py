"""bench/stream_gaps.py end to end at a small size: 8 streams and 2 ~1 MB pastes against a real
`kvreplay serve` process with the shipped settings. Checks that every stream ends cleanly, its
gap statistics are computed and the pastes get their 4xx; the timing target itself is not
asserted (CI machines are shared and noisy)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import stream_gaps  # noqa: E402

pytestmark = pytest.mark.slow

NUM_CLIENTS = 8
NUM_TOKENS = 24


def test_stream_gaps_bench_with_pastes(tmp_path, capsys):
    out = tmp_path / "gaps.json"
    (result,) = stream_gaps.main(["--clients", str(NUM_CLIENTS), "--tokens", str(NUM_TOKENS),
                                  "--modes", "refused", "--pastes", "2", "--paste-interval", "0",
                                  "--kv-cache-memory", "64MiB", "--json", str(out)])
    assert result["errors"] == 0, [s for s in result["streams"] if s["error"]]
    for stream in result["streams"]:
        assert stream["finish"] == "length" and stream["chunks"] >= NUM_TOKENS - 2, stream
        assert stream["all_median_s"] > 0 and math.isfinite(stream["all_ratio"]), stream
        assert stream["all_ratio"] >= 1.0, stream  # p99 of a stream's gaps is at least their median
    assert result["all"]["worst_ratio"] == max(s["all_ratio"] for s in result["streams"])
    assert result["pastes"] == 2, result["paste_log"]
    # the shipped settings: a 1 MB paste is refused by its bytes (400), the 1.1 MB one by the body limit
    assert result["paste_statuses"] == {"400 context_length_exceeded": 1, "413": 1}, result["paste_log"]
    saved = json.loads(out.read_text())
    assert saved["runs"][0]["all"] == result["all"] and saved["args"]["clients"] == NUM_CLIENTS
    table = capsys.readouterr().out
    assert "| refused | all | 8 (0) |" in table and "| refused | steady | 8 (0) |" in table


def test_stream_gaps_gap_statistics_and_arguments():
    assert stream_gaps.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert stream_gaps.percentile([1.0] * 99 + [101.0], 99) == pytest.approx(2.0)
    raw = {"wall_s": 2.0, "all_started_at": 1.5, "pastes": [],
           "streams": [{"index": 0, "times": [0.0, 0.1, 0.2, 1.2, 1.6, 1.7, 1.8], "finish": "length",
                        "done": True, "error": None}]}
    result = stream_gaps.summarize("off", raw)
    stream = result["streams"][0]
    assert stream["all_median_s"] == pytest.approx(0.1) and stream["all_max_s"] == pytest.approx(1.0)
    assert stream["steady_median_s"] == pytest.approx(0.1) and stream["steady_max_s"] == pytest.approx(0.1)
    assert result["all"]["streams_over_target"] == 1 and result["steady"]["streams_over_target"] == 0
    with pytest.raises(SystemExit):
        stream_gaps.parse_args(["--modes", "sometimes"])
    with pytest.raises(SystemExit):
        stream_gaps.parse_args(["--tokens", "2"])


def test_the_tokenizing_thread_runs_at_a_lower_priority():
    """PromptPreparer's thread raises its own niceness (tokenize_nice), not the process's."""
    import os
    import threading

    from kvreplay.server import prompts
    if not hasattr(os, "setpriority"):
        pytest.skip("no per-thread priorities here")
    process_nice = os.getpriority(os.PRIO_PROCESS, 0)
    seen = {}

    def work():
        prompts._lower_priority(3)
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["thread"] == min(19, process_nice + 3)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == process_nice

"""bench/soak.py at a small size (issue 40): a real `kvreplay serve` under replay with the session
tier on disk, mixed clients, a burst over the queue, a kill -9 and a restart. Checks the outcome
accounting, not the figures (docs/benchmarks.md holds those, from the 10-minute run)."""
from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import soak  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_short_soak_with_a_kill_serves_again_and_leaves_the_pool_whole(tmp_path):
    report = soak.soak(["--duration", "40", "--kill-at", "0.5", "--clients", "3", "--burst-every", "12",
                        "--length-scale", "0.125", "--output-tokens", "12", "--kv-cache-memory", "32MiB",
                        "--bad", "0.15", "--disconnect", "0.15", "--max-queued-seqs", "8",
                        "--json", str(tmp_path / "soak.json")])
    assert report["passed"], report["error_samples"]
    assert report["five_xx"] == 0 and report["errors"] == 0 and report["retry_after_missing"] == 0
    outcomes = report["outcomes"]
    kinds = {key.split(" -> ")[0] for key in outcomes}
    assert {"bad", "burst", "disconnect"} <= kinds, outcomes
    assert all(400 <= int(key.split(" -> ")[1]) < 500 for key in outcomes if key.startswith("bad ")), outcomes
    assert outcomes.get("burst -> 429", 0) > 0, outcomes  # a burst of max_queued_seqs + 16 overflows the queue
    assert report["served"] > 0 and report["latency_s"]
    crash = report["crash"]
    assert crash["restart_s"] > 0 and crash["temporaries_after_restart"] == 0, crash
    assert len(report["lives"]) == 2 and all(life["rss_end_mib"] for life in report["lives"])
    assert report["integrity"]["integrity"] == "ok" and report["integrity"]["num_running"] == 0
    assert report["exit_code_after_sigterm"] == 0
    assert (tmp_path / "soak.json").exists()


def test_soak_arguments_are_checked():
    for bad in (["--duration", "0"], ["--kill-at", "1"], ["--bad", "0.7", "--disconnect", "0.5"]):
        with pytest.raises(SystemExit):
            soak.parse_args(bad)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt and malloc_trim")
def test_the_server_process_uses_one_malloc_arena_and_returns_free_pages():
    """Per-thread arenas grew a server's RSS ~1.5 MiB per request (the soak found it): the runner
    asks for one arena before any thread starts (a fresh process here, so this test's threads
    don't count), and the engine loop returns free heap pages every TRIM_EVERY_STEPS steps."""
    probe = ("import sys; from kvreplay.server import allocator; "
             "ok = allocator.use_one_arena(); allocator.release_free_memory(); sys.exit(0 if ok else 3)")
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0

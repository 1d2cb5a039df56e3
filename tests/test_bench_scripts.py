"""The side-by-side benches run end to end on the default model (tiny settings) and refuse bad
arguments with argparse's usage error."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


@pytest.mark.parametrize("script,labels", [("quant_panels.py", ("blocks", "bf16 panels")),
                                           ("fused_decode.py", ("fused decode", "layer code"))])
def test_side_by_side_bench_runs(script, labels):
    from kvreplay.engine import cpu_kernels
    ops = cpu_kernels.layer_ops()
    if ops is None or not ops.has_panel_linear():
        pytest.skip("no panel kernel here: neither bench applies")
    result = _run(script, "--batches", "2", "--rounds", "1", "--decode-tokens", "3", "--prompt-tokens", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"| batch | {labels[0]}, decode tok/s | {labels[1]}, decode tok/s | ratio |" in result.stdout
    row = [line for line in result.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(row) == 1 and row[0].rstrip().endswith("x |")


@pytest.mark.parametrize("script", ["quant_panels.py", "fused_decode.py"])
def test_side_by_side_bench_rejects_bad_arguments(script):
    result = _run(script, "--rounds", "0")
    assert result.returncode == 2 and "--rounds and --decode-tokens must be at least 1" in result.stderr

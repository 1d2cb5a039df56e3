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
                                           ("fused_decode.py", ("fused decode", "layer code")),
                                           ("fused_decode.py --compare stack", ("decode_layers", "decode_layer each")),
                                           ("fused_decode.py --compare greedy", ("argmax head", "logits"))])
def test_side_by_side_bench_runs(script, labels):
    from kvreplay.kernels import cpu_kernels
    ops = cpu_kernels.layer_ops()
    if ops is None or not ops.has_panel_linear():
        pytest.skip("no panel kernel here: neither bench applies")
    script, *options = script.split()
    result = _run(script, *options, "--batches", "2", "--rounds", "1", "--decode-tokens", "3", "--prompt-tokens", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"| batch | {labels[0]}, decode tok/s | {labels[1]}, decode tok/s | ratio " \
           f"| {labels[0]}, prefill tok/s | {labels[1]}, prefill tok/s | ratio |" in result.stdout
    row = [line for line in result.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(row) == 1 and row[0].count("x |") == 2, result.stdout


@pytest.mark.parametrize("script", ["quant_panels.py", "fused_decode.py", "int_products.py"])
def test_side_by_side_bench_rejects_bad_arguments(script):
    result = _run(script, "--rounds", "0")
    assert result.returncode == 2 and "--rounds and --decode-tokens must be at least 1" in result.stderr


def test_int_products_bench_runs_speed_and_quality():
    from kvreplay.kernels import cpu_kernels
    ops = cpu_kernels.layer_ops()
    if ops is None or not ops.has_panel_linear() or not ops.has_int_products():
        pytest.skip("no integer products in this build of the panel kernel")
    result = _run("int_products.py", "--batches", "2", "--rounds", "1", "--decode-tokens", "3", "--prompt-tokens", "16",
                  "--text-tokens", "40")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| batch | integer products, decode tok/s | bf16 panels, decode tok/s | ratio |" in result.stdout
    assert "40 tokens of text; fp32 perplexity" in result.stdout
    for form in ("integer products", "bf16 panels"):
        row = [line for line in result.stdout.splitlines() if line.startswith(f"| {form} |")]
        assert len(row) == 1 and row[0].count("|") == 6, result.stdout
    bad = _run("int_products.py", "--text-tokens", "1")
    assert bad.returncode == 2 and "--text-tokens must be at least 2" in bad.stderr


def test_fused_decode_bench_rejects_an_unknown_comparison():
    result = _run("fused_decode.py", "--compare", "fast")
    assert result.returncode == 2 and "invalid choice: 'fast'" in result.stderr


@pytest.mark.slow
def test_throughput_bench_runs_both_engines(tmp_path):
    """`kvreplay bench throughput`: kvreplay and transformers each in its own process, a table row
    with both engines' figures and their ratios, and the same figures in the JSON."""
    out = tmp_path / "throughput.json"
    result = subprocess.run([sys.executable, "-m", "kvreplay", "bench", "throughput", "--batches", "2",
                             "--prompt-tokens", "16", "--decode-tokens", "3", "--repeats", "1",
                             "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    import json
    data = json.loads(out.read_text())
    assert [r["engine"] for r in data["runs"]] == ["kvreplay", "transformers"]
    row, = data["rows"]
    assert row["batch"] == 2 and row["kvreplay_decode_tok_s"] > 0 and row["transformers_decode_tok_s"] > 0
    assert row["decode_ratio"] == pytest.approx(row["kvreplay_decode_tok_s"] / row["transformers_decode_tok_s"])
    line = f"| 2 | {row['kvreplay_prefill_tok_s']:.0f} | {row['kvreplay_decode_tok_s']:.1f} |"
    assert any(text.startswith(line) and text.rstrip().endswith(f"{row['decode_ratio']:.2f}x |")
               for text in result.stdout.splitlines()), result.stdout


@pytest.mark.parametrize("args,message", [
    (["--batches", "0"], "expected batch sizes like 1,8,32, got '0'"),
    (["--batches", "1,x"], "expected batch sizes like 1,8,32"),
    (["--repeats", "0"], "expected a positive integer, got '0'"),
    (["--device", "tpu"], "device must be 'cpu' or 'cuda[:N]'"),
    (["--model", "/no/such/model.gguf"], "does not exist"),
    (["--llama-cpp", "--model", "."], "--llama-cpp needs a .gguf model file"),
])
def test_throughput_bench_rejects_bad_arguments(args, message, capsys):
    from kvreplay.cli import main
    try:
        code = main(["bench", "throughput", *args])
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err


def test_old_script_name_takes_the_same_arguments():
    result = _run("engine_throughput.py", "--help")
    assert result.returncode == 0 and "--llama-cpp" in result.stdout and "--batches" in result.stdout


def test_decode_steps_bench_times_each_thread_count():
    result = _run("decode_steps.py", "--batch", "2", "--prompt-tokens", "16", "--decode-tokens", "3",
                  "--rounds", "1", "--threads", "1,2")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|") for line in result.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2
    one, two = rows
    assert float(one[2]) > 0 and float(two[2]) > 0  # median decode step, ms
    assert one[4].strip() == "1.00x" and one[5].strip() == ""  # the first count is the reference
    assert two[4].strip().endswith("x") and two[5].strip() != ""  # speedup and serial share


@pytest.mark.parametrize("args,message", [(["--threads", "0"], "thread counts must be positive"),
                                          (["--threads", "a,b"], "comma-separated thread counts"),
                                          (["--rounds", "0"], "expected a positive integer")])
def test_decode_steps_bench_rejects_bad_arguments(args, message):
    result = _run("decode_steps.py", *args)
    assert result.returncode == 2 and message in result.stderr


def test_attention_tiles_bench_times_both_kernels():
    from kvreplay.kernels import cpu_kernels
    if cpu_kernels.decode_attention() is None:
        pytest.skip("no compiled decode attention here")
    result = _run("attention_tiles.py", "--batch", "2", "--context", "40", "--layers", "2", "--rounds", "2",
                  "--threads", "1", "--placements", "resident,compact")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| placement | tiles, ms | vector, ms | ratio |" in result.stdout
    rows = {line.split("|")[1].strip(): line.split("|") for line in result.stdout.splitlines()
            if line.startswith("| resident |") or line.startswith("| compact |")}
    assert set(rows) == {"resident", "compact"}
    for cells in rows.values():
        assert float(cells[2]) > 0 and float(cells[3]) > 0 and cells[4].strip().endswith("x")
    import torch
    if not torch.ops.kvreplay_cpu.has_amx_attention():
        assert "no AMX tiles here" in result.stdout


@pytest.mark.parametrize("args,message", [(["--rounds", "0"], "expected a positive integer"),
                                          (["--placements", "nowhere"], "placements are resident"),
                                          (["--layers", "x"], "expected a positive integer")])
def test_attention_tiles_bench_rejects_bad_arguments(args, message):
    result = _run("attention_tiles.py", *args)
    assert result.returncode == 2 and message in result.stderr

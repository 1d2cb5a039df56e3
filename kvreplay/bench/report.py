"""JSON and markdown for bench results."""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time


def environment() -> dict:
    """Where a result came from: enough to tell two runs' machines apart."""
    import torch
    return {"time": time.strftime("%Y-%m-%d %H:%M:%S %z"), "python": sys.version.split()[0],
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "machine": platform.machine(), "platform": platform.platform(),
            "command": "kvreplay " + " ".join(sys.argv[1:]) if sys.argv and "kvreplay" in sys.argv[0] else None}


def write_json(path: str, result: dict) -> None:
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_strict(result), f, indent=2)
        f.write("\n")


def _strict(value):
    """Strict JSON: infinities and NaN (a burst's request rate) become strings."""
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _num(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return f"{value:,.{digits}f}"


def _mib(num_bytes) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**20:,.1f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def serve_markdown(runs: list[dict], peers: list[dict] | None = None) -> str:
    """Runs are ServeRun.as_dict() results; latencies in ms as mean / p50 / p99."""
    rows = []
    for run in runs:
        m, counters = run["metrics"], run["metrics"]["counters"]
        peaks = run.get("kv", {}).get("peak_bytes", {})
        triple = lambda s: " / ".join(_num(s[k]) for k in ("mean", "p50", "p99"))  # noqa: E731
        rows.append([run["label"], f"{m['num_completed']}/{m['num_requests']}",
                     _num(m["request_throughput"], 2), _num(m["output_token_throughput"]),
                     _num(m["total_token_throughput"]), triple(m["ttft_ms"]), triple(m["tpot_ms"]),
                     f"{_num(m['itl_ms']['p50'])} / {_num(m['itl_ms']['p99'])}", triple(m["e2e_ms"]),
                     ", ".join(f"{tier} {_mib(b)}" for tier, b in peaks.items()) or "-",
                     str(counters["pauses"] + counters["preemptions"]), str(counters["replays"]),
                     str(counters["replayed_tokens"])])
    text = table(["policy", "done", "req/s", "out tok/s", "total tok/s", "TTFT ms (mean/p50/p99)",
                  "TPOT ms (mean/p50/p99)", "ITL ms (p50/p99)", "E2E ms (mean/p50/p99)",
                  "peak KV MiB", "pauses", "replays", "replayed tok"], rows)
    if peers:
        text += "\n\n" + peers_markdown(peers)
    return text


def peers_markdown(peers: list[dict]) -> str:
    rows = [[p["label"], p.get("status", "ok"), _num(p.get("output_token_throughput")),
             _num(p.get("e2e_mean_ms")), _num(p.get("throughput_ratio"), 2), p.get("note", "")]
            for p in peers]
    return table(["peer", "status", "out tok/s", "E2E mean ms", "kvreplay / peer (tok/s)", "note"], rows)


def _resident(retrieval: dict | None) -> str:
    """Per-request resident KV (hot + key index) against full's, over the decode steps."""
    if not retrieval or retrieval.get("resident_mean") is None:
        return "-"
    text = (f"{retrieval['resident_first']:.2f}, {retrieval['resident_mean']:.2f}, "
            f"{retrieval['resident_max']:.2f}")
    return text + (f" ({retrieval['replays']})" if "replays" in retrieval else "")


def quality_markdown(result: dict) -> str:
    """Summary per (policy, budget), then each run's retrieval grid (lengths x depths)."""
    rows = []
    for run in result["runs"]:
        r, f, p = run.get("retrieval"), run.get("fidelity"), run.get("perplexity")
        ratios = ", ".join(f"{n}: {v:.2f}" for n, v in run["memory_ratio"].items())
        rows.append([run["policy"], run["budget"], ratios,
                     f"{r['accuracy']:.2f} ({r['num_cases']} cases, {r['num_refused']} refused)" if r else "-",
                     _resident(r), _resident(f),
                     _num(f["top1_agreement"], 3) if f else "-", _num(f["matching_prefix"]) if f else "-",
                     f"{f['kl']:.1e}" if f and f["kl"] is not None else "-",
                     (_num(p["perplexity"], 2) + f" ({p['tokens']} tok)") if p and p["perplexity"] else
                     (p["method"] if p else "-")])
    text = table(["policy", "budget", "budget / full KV (by length)", "retrieval acc",
                  "retrieval resident / full: first, mean, max (replays)",
                  "fidelity resident / full: first, mean, max", "top-1 agreement", "matching prefix", "KL vs full", "perplexity"], rows)
    for run in result["runs"]:
        grid = (run.get("retrieval") or {}).get("grid")
        if not grid:
            continue
        depths = list(next(iter(grid.values())))
        text += (f"\n\nRetrieval accuracy, {run['policy']} at {run['budget']} (rows: haystack tokens, "
                 f"columns: depth)\n\n")
        text += table(["tokens"] + depths, [[n] + [f"{cells[d]:.2f}" for d in depths] for n, cells in grid.items()])
    return text

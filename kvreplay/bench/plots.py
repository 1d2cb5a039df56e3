"""PNG figures from bench JSON results (matplotlib, an optional dependency).

- throughput against budget: one line per policy, output tokens/s and p50 TTFT per KV budget;
- memory against quality: retrieval accuracy and fidelity per policy against the budget as a
  fraction of the KV that `full` needs for the request.
"""
from __future__ import annotations

from collections import defaultdict


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError("plots need matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _caption(fig, results: list[dict]) -> int:
    """The commands that made the figure, at its foot; returns the number of lines."""
    import textwrap
    commands = [r.get("environment", {}).get("command") for r in results]
    text = "\n".join(textwrap.fill(c, 190) for c in commands if c)
    if text:
        fig.text(0.01, 0.005, text, fontsize=5.5, family="monospace", alpha=0.7)
    return text.count("\n") + 1 if text else 0


def throughput_vs_budget(results: list[dict], path: str) -> None:
    """`results`: `bench serve` results with runs over several budgets; several results (repeats)
    become separate lines."""
    plt = _pyplot()
    by_policy = defaultdict(list)
    for number, result in enumerate(results, 1):
        for run in result["runs"]:
            m = run["metrics"]
            name = run.get("policy", run["label"]) + (f" (run {number})" if len(results) > 1 else "")
            by_policy[name].append(
                (run["kv"]["capacity_bytes"] / 2**20, m["output_token_throughput"] or 0.0,
                 (m["ttft_ms"]["p50"] or 0.0) / 1000, m["counters"]["pauses"] + m["counters"]["preemptions"]))
    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for policy, points in sorted(by_policy.items()):
        points.sort()
        budgets = [p[0] for p in points]
        ax_tput.plot(budgets, [p[1] for p in points], marker="o", label=policy)
        ax_ttft.plot(budgets, [p[2] for p in points], marker="o", label=policy)
        for budget, tput, _, pauses in points:
            if pauses:
                ax_tput.annotate(f"{pauses} paused", (budget, tput), fontsize=7,
                                 textcoords="offset points", xytext=(4, -10))
    workload = results[0].get("workload", {})
    title = (f"{workload.get('num_requests')} requests, length scale {workload.get('length_scale')}, "
             f"{workload.get('output_tokens')} output tokens, rate {workload.get('request_rate')}/s")
    for ax, label in ((ax_tput, "output tokens / s"), (ax_ttft, "TTFT p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV budget (MiB)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Throughput against KV budget ({title})", fontsize=9)
    lines = _caption(fig, results)
    fig.tight_layout(rect=(0, 0.02 + 0.02 * lines, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def memory_vs_quality(result: dict, path: str) -> None:
    """`result`: a `bench quality` result with runs over policies and budgets."""
    plt = _pyplot()
    fig, (ax_ret, ax_fid) = plt.subplots(1, 2, figsize=(10, 4))
    by_policy = defaultdict(list)
    for run in result["runs"]:
        by_policy[run["policy"]].append(run)
    for policy, runs in sorted(by_policy.items()):
        runs.sort(key=lambda r: r["budget_bytes"])
        for length in (runs[0].get("retrieval") or {}).get("grid", {}):
            points = [(r["memory_ratio"][length], sum(r["retrieval"]["grid"][length].values())
                       / len(r["retrieval"]["grid"][length])) for r in runs]
            ax_ret.plot(*zip(*points), marker="o", label=f"{policy}, {length} tokens")
        fidelity = [(r["budget_bytes"] / 2**20, r["fidelity"]["top1_agreement"]) for r in runs
                    if r.get("fidelity") and r["fidelity"]["top1_agreement"] is not None]
        if fidelity:
            ax_fid.plot(*zip(*fidelity), marker="o", label=policy)
    ax_ret.set_xscale("log", base=2)
    ax_ret.set_xlabel("KV budget / KV that full needs for the request")
    ax_ret.set_ylabel("retrieval exact match")
    ax_ret.axvline(1.0, color="grey", linestyle=":", linewidth=1)
    ax_fid.set_xscale("log", base=2)
    ax_fid.set_xlabel("KV budget (MiB)")
    ax_fid.set_ylabel("top-1 agreement with full attention")
    for ax in (ax_ret, ax_fid):
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Memory against quality (refused requests count as wrong)", fontsize=9)
    lines = _caption(fig, [result])
    fig.tight_layout(rect=(0, 0.02 + 0.02 * lines, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)

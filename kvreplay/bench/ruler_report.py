"""Markdown tables and the PNG figure of a `bench quality --suite ruler` result (kvreplay/bench/ruler.py).

Tables: accuracy per task x (policy, ratio) at each length with RULER's average; per run and
length the average, the measured resident KV share and the replay cost (recomputed tokens per
request, replays, wall time); the multi-turn chat's accuracy per round. Every figure but the
timing columns depends only on the command, so the same command gives the same tables.
"""
from __future__ import annotations

from kvreplay.bench.report import table


def _score(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _share(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def ruler_markdown(result: dict) -> str:
    runs = result["runs"]
    spec = result["spec"]
    labels = [run["label"] for run in runs]
    parts = [f"RULER-style suite: {spec['cases']} cases per task and length, seed {spec['seed']}; "
             f"scores are string_match_all x 100; `policy@r` runs at resident_ratio r."
             + (" Context first: each case's context is a kept session cut by its policy before "
                "the question is sent." if spec.get("context_first") else "")]
    for length in map(str, spec["lengths"]):
        tasks = [t for t in spec["tasks"] if t != "multiturn"]
        rows = [[task] + [_score(run["tasks"][task][length]["score"]) for run in runs] for task in tasks]
        if tasks:
            rows.append(["**average**"] + [_score(run["lengths"][length]["average"]) for run in runs])
        if "multiturn" in spec["tasks"]:
            rows.append(["multiturn (4 rounds)"] + [_score(run["lengths"][length]["multiturn"]) for run in runs])
        parts.append(f"Accuracy at {length} tokens\n\n" + table(["task"] + labels, rows))
    rows = []
    for run in runs:
        for length, s in run["lengths"].items():
            rows.append([run["label"], length, _score(s["average"]), _score(s["multiturn"]),
                         _share(s["resident_first"]), _share(s["resident_mean"]),
                         f"{s['replays_per_request']:.2f}", f"{s['replayed_tokens_per_request']:.0f}",
                         f"{s['dropped_tokens_per_request']:.0f}", f"{s['wall_s']:.1f}",
                         f"{s['wall_s'] / s['requests']:.2f}"])
    parts.append("Resident KV share (resident bytes / full's, after prefill and mean over decode steps) and "
                 "replay cost per request (wall times vary run to run)\n\n" + table(
                     ["run", "length", "average", "multiturn", "resident after prefill", "resident mean",
                      "replays", "recomputed tokens", "dropped tokens", "wall s", "s / request"], rows))
    over = [f"{run['label']} ({', '.join(run['over_ratio'])} tokens)" for run in runs if run.get("over_ratio")]
    if over:
        parts.append("Above their ratio (measured resident share more than 0.05 over it; the rows are not "
                     "at that budget): " + "; ".join(over))
    if "multiturn" in spec["tasks"]:
        rows = [[run["label"], length] + [_score(v) for v in cells["rounds"]]
                for run in runs for length, cells in run["tasks"]["multiturn"].items()]
        rounds = len(rows[0]) - 2 if rows else 0
        parts.append("Multi-turn chat: accuracy per round (each round asks about another quarter of "
                     "the document)\n\n" + table(["run", "length"] + [f"round {i + 1}" for i in range(rounds)], rows))
    return "\n\n".join(parts)


def ruler_plot(result: dict, path: str) -> None:
    """Average accuracy against the measured resident KV share, one line per policy, one panel
    per length; `full` as a point at its share with a dotted line across."""
    from kvreplay.bench.plots import _caption, _pyplot
    plt = _pyplot()
    lengths = [str(n) for n in result["spec"]["lengths"]]
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    policies = list(dict.fromkeys(run["policy"] for run in result["runs"]))
    for ax, length in zip(axes[0], lengths):
        for policy in policies:
            points = sorted((run["lengths"][length]["resident_mean"] or 0.0, run["lengths"][length]["average"])
                            for run in result["runs"] if run["policy"] == policy
                            and run["lengths"][length]["average"] is not None)
            if not points:
                continue
            if policy == "full":
                ax.axhline(points[0][1], color="black", linestyle=":", linewidth=1)
                ax.plot(*zip(*points), marker="*", markersize=11, color="black", linestyle="", label="full")
            else:
                ax.plot(*zip(*points), marker="o", label=policy)
        ax.set_xlim(0, 1.05)
        ax.set_ylim(-3, 103)
        ax.set_xlabel("resident KV / full's (measured, mean over decode steps)")
        ax.set_ylabel("RULER average accuracy")
        ax.set_title(f"{length} tokens", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"RULER-style suite: accuracy against resident KV ({result['spec']['cases']} cases "
                 f"per task and length)", fontsize=9)
    lines = _caption(fig, [result])
    fig.tight_layout(rect=(0, 0.02 + 0.02 * lines, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)

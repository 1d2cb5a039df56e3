"""`kvreplay bench quality --suite ruler`: RULER's synthetic tasks (kvreplay/bench/ruler_tasks.py)
and the multi-turn chat (ruler_multiturn.py) per KV policy and resident budget
(docs/architecture.md §8).

Each lossy policy runs at each `resident_ratio` (the resident share of full's KV per sequence),
`full` once, all through the real engine with prefix caching off and a pool sized so that it
never limits (`concurrent` full-length requests under the low watermark): the ratio is the only
budget. Every case of one (policy, ratio, task, length) is one batched greedy `generate` call.

Per case: RULER's `string_match_all` score; the resident KV share measured at every decode step
from the KV manager (`Reclaimer.resident_share`: hot blocks, cold tier and key index, against the blocks
`full` holds for the same tokens), first (right after prefill and its trimming), mean and max;
the request's counters (replays, replayed_tokens, dropped_tokens). Per batch: wall time.
"""
from __future__ import annotations

import gc
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

from kvreplay.bench.report import environment
from kvreplay.bench.ruler_multiturn import (EXTRA_TOKENS, MAX_TOKENS as MULTITURN_MAX_TOKENS,
                                            MIN_LENGTH as MULTITURN_MIN_LENGTH, ROUNDS,
                                            make_multiturn_case, next_turn, round_prompt)
from kvreplay.bench.ruler_tasks import TASKS, make_case
from kvreplay.bench.ruler_text import TextKit, string_match_all
from kvreplay.bench.suite import make_llm
from kvreplay.config import EngineConfig
from kvreplay.kv.policy import POLICIES

SUITE_TASKS = (*TASKS, "multiturn")
STAT_KEYS = ("replays", "replayed_tokens", "dropped_tokens", "approx_tokens", "pauses",
             "prefix_hit_tokens")


def _min_length(task: str) -> int:
    return MULTITURN_MIN_LENGTH if task == "multiturn" else TASKS[task].min_length


def _answer_room(task: str) -> int:
    """Tokens a task needs beyond its first prompt: answers (and later rounds for multiturn)."""
    return EXTRA_TOKENS + MULTITURN_MAX_TOKENS if task == "multiturn" else TASKS[task].max_tokens


@dataclass(frozen=True)
class RulerSpec:
    """What to run. Checked on construction: a bad value is a ValueError naming its remedy."""
    tasks: tuple[str, ...] = SUITE_TASKS
    lengths: tuple[int, ...] = (4096, 7680)
    cases: int = 25
    ratios: tuple[float, ...] = (0.1, 0.25, 0.5)
    seed: int = 0
    concurrent: int = 8
    context_first: bool = False  # single-turn tasks: the context is prefilled (and cut) before the question

    def __post_init__(self):
        unknown = [t for t in self.tasks if t not in SUITE_TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"unknown task(s) {unknown}; --tasks takes a comma-separated subset of "
                             f"{','.join(SUITE_TASKS)}")
        if not self.lengths:
            raise ValueError("give at least one length: --lengths 4096,7680")
        for task in self.tasks:
            if min(self.lengths) < _min_length(task):
                raise ValueError(f"task {task} needs prompts of at least {_min_length(task)} tokens, "
                                 f"got --lengths {min(self.lengths)}: raise it or leave {task} out of --tasks")
        if self.cases < 1:
            raise ValueError(f"--cases must be at least 1, got {self.cases}")
        if self.concurrent < 1:
            raise ValueError(f"--concurrent must be at least 1, got {self.concurrent}")
        bad = [r for r in self.ratios if not 0 < r <= 1]
        if bad or not self.ratios:
            raise ValueError(f"--ratios are resident shares of full's KV in (0, 1], like 0.1,0.25,0.5; "
                             f"got {list(self.ratios)}")

    def check_context(self, context_tokens: int) -> None:
        need = max(self.lengths) + max(_answer_room(t) for t in self.tasks)
        if need > context_tokens:
            room = context_tokens - max(_answer_room(t) for t in self.tasks)
            raise ValueError(f"--lengths {max(self.lengths)} plus the answers needs {need} tokens but "
                             f"the model's context is {context_tokens}: use lengths of at most {room}")


def default_policies() -> list[str]:
    """`full` and every lossy preset the engine has."""
    return ["full"] + [name for name in POLICIES if name != "full"]


def plan_runs(policies: list[str], ratios: tuple[float, ...]) -> list[tuple[str, float | None]]:
    """(policy, resident ratio) pairs: `full` once (no ratio), each lossy policy at each ratio."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"unknown policy(ies) {unknown}; --policies takes names from {','.join(POLICIES)}")
    return [(p, None) if p == "full" else (p, r) for p in dict.fromkeys(policies)
            for r in ((None,) if p == "full" else ratios)]


def label(policy: str, ratio: float | None) -> str:
    return policy if ratio is None else f"{policy}@{ratio:g}"


def pool_bytes(spec: RulerSpec, model_config, dtype: torch.dtype, block_size: int, low: float) -> int:
    """A KV pool holding `concurrent` requests of the longest kind whole, under `low`."""
    tokens = max(spec.lengths) + max(_answer_room(t) for t in spec.tasks) + block_size
    per_request = -(-tokens // block_size) * block_size * model_config.kv_bytes_per_token(
        torch.finfo(dtype).bits // 8)
    return int(min(spec.cases, spec.concurrent) * per_request / low) + 64 * 2**20


def make_cases(kit: TextKit, spec: RulerSpec) -> dict[tuple[str, int], list]:
    """Every case of the spec, keyed by (task, length): built before any model loads."""
    cases = {}
    for length in spec.lengths:
        for task in spec.tasks:
            cases[task, length] = [make_multiturn_case(kit, length, i, spec.seed) if task == "multiturn"
                                   else make_case(kit, task, length, i, spec.seed)
                                   for i in range(spec.cases)]
    return cases


def _measure(engine, shares: dict[str, list[float]]) -> None:
    """Each decoding request's resident KV against the blocks `full` would hold for it."""
    reclaim = engine.scheduler.reclaim  # quest: the share decode attention reads (its memory is full's)
    for seq in engine.scheduler.running:
        if seq.num_uncomputed_tokens == 1:
            shares.setdefault(seq.request_id, []).append(reclaim.resident_share(seq))


def run_batch(llm, prompts: list[list[int]], max_tokens: int, progress: bool, keep: bool = False,
              continues: list[str] | None = None) -> tuple[list[dict], float]:
    """One batched greedy generate; per prompt its text, resident shares and counters (and,
    under "_request_id" and "_tokens", what a kept session's next round continues)."""
    from kvreplay.sampling import SamplingParams
    shares: dict[str, list[float]] = {}
    started = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                           use_tqdm=progress, on_step=lambda engine: _measure(engine, shares),
                           keep=keep, continues=continues)
    wall_s = time.perf_counter() - started
    rows = []
    for output in outputs:
        seen = shares.get(output.request_id, [])
        stats = output.outputs[0].stats.as_dict()
        rows.append({"output": output.text,
                     "resident_first": seen[0] if seen else None,
                     "resident_mean": sum(seen) / len(seen) if seen else None,
                     "resident_max": max(seen) if seen else None,
                     "stats": {k: stats[k] for k in STAT_KEYS},
                     "_request_id": output.request_id,
                     "_tokens": output.prompt_token_ids + output.token_ids})
    return rows, wall_s


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _cell(rows: list[dict], wall_s: float) -> dict:
    """A (task, length) summary over its case rows."""
    return {"score": _mean(r["score"] for r in rows), "num_cases": len(rows), "wall_s": wall_s,
            "resident_first": _mean(r["resident_first"] for r in rows),
            "resident_mean": _mean(r["resident_mean"] for r in rows),
            "resident_max": max((r["resident_max"] for r in rows if r["resident_max"] is not None),
                                default=None),
            **{k: sum(r["stats"][k] for r in rows) for k in STAT_KEYS}, "cases": rows}


def _run_task(llm, kit: TextKit, cases: list, progress: bool, context_first: bool = False,
              concurrent: int = 8) -> dict:
    if context_first:
        rows, wall_s = _context_first(llm, cases, progress, concurrent)
    else:
        rows, wall_s = run_batch(llm, [c.prompt_token_ids for c in cases], cases[0].max_tokens, progress)
    for case, row in zip(cases, rows):
        del row["_request_id"], row["_tokens"]
        row.update(index=case.index, score=string_match_all(row["output"], case.references),
                   references=case.references, needles=[[n.start, n.end] for n in case.needles])
    return _cell(rows, wall_s)


def _context_first(llm, cases: list, progress: bool, concurrent: int) -> tuple[list[dict], float]:
    """Each case as two requests of one kept session: the context alone (one token written and
    discarded; the policy cuts the KV as its prefill ends, as kvpress compresses a context before
    the question is known), then the whole prompt continuing it. Rows are the second request's;
    the time is both's. `concurrent` cases at a time, so kept sessions never crowd the pool."""
    rows, wall_s = [], 0.0
    for start in range(0, len(cases), concurrent):
        group = cases[start:start + concurrent]
        first, seconds = run_batch(llm, [c.prompt_token_ids[:c.question_start] for c in group], 1,
                                   progress, keep=True)
        second, more = run_batch(llm, [c.prompt_token_ids for c in group], group[0].max_tokens, progress,
                                 continues=[row["_request_id"] for row in first])
        rows += second
        wall_s += seconds + more
    return rows, wall_s


def _run_multiturn(llm, kit: TextKit, cases: list, progress: bool) -> dict:
    """Round by round, each round one batched call over every case's chat, which keeps its KV
    from one round to the next (a kept session: what the policy evicted for the earlier
    questions stays evicted, what replay dropped is replayed) and prefills only the new turn."""
    eos = llm.tokenizer.eos_token_id
    kept: list[tuple[str, list[int]]] = []
    rounds, all_rows, wall_s = [], [], 0.0
    for r in range(ROUNDS):
        if r == 0:
            prompts = [round_prompt(kit, case, 0, []) for case in cases]
        else:  # the chat so far (its closing EOS left to the template's glue), then the new turn
            prompts = [(tokens[:-1] if tokens[-1] == eos else tokens) + next_turn(kit, case, r)
                       for (_, tokens), case in zip(kept, cases)]
        rows, seconds = run_batch(llm, prompts, cases[0].max_tokens, progress, keep=r < ROUNDS - 1,
                                  continues=[request_id for request_id, _ in kept] or None)
        wall_s += seconds
        kept = [(row.pop("_request_id"), row.pop("_tokens")) for row in rows]
        for i, (case, row) in enumerate(zip(cases, rows)):
            row.update(index=case.index, round=r + 1, prompt_tokens=len(prompts[i]),
                       score=string_match_all(row["output"], [case.values[r]]),
                       references=[case.values[r]])
        rounds.append(_mean(row["score"] for row in rows))
        all_rows += rows
    return _cell(all_rows, wall_s) | {"rounds": rounds}


def _summaries(tasks: dict, lengths: tuple[int, ...]) -> dict:
    """Per length: RULER's average over the tasks run (multiturn apart), the resident share and
    the replay cost over every request."""
    out = {}
    for length in lengths:
        key = str(length)
        cells = {t: c[key] for t, c in tasks.items()}
        ruler = [c["score"] for t, c in cells.items() if t != "multiturn"]
        requests = sum(len(c["cases"]) for c in cells.values())
        out[key] = {"average": _mean(ruler), "multiturn": cells.get("multiturn", {}).get("score"),
                    "resident_mean": _mean(r["resident_mean"] for c in cells.values() for r in c["cases"]),
                    "resident_first": _mean(r["resident_first"] for c in cells.values() for r in c["cases"]),
                    "requests": requests, "wall_s": sum(c["wall_s"] for c in cells.values()),
                    **{f"{k}_per_request": sum(c[k] for c in cells.values()) / requests
                       for k in ("replays", "replayed_tokens", "dropped_tokens")}}
    return out


def over_ratio(run: dict, slack: float = 0.05) -> list[str]:
    """Lengths at which a run's measured resident share (mean over decode steps) is above its
    ratio by more than `slack`: the policy's knobs keep more than the budget (a window wider
    than the ratio, or a preset that ignores resident_ratio), so its row is not at that budget."""
    if run["ratio"] is None:
        return []
    return [length for length, s in run["lengths"].items()
            if s["resident_mean"] is not None and s["resident_mean"] > run["ratio"] + slack]


def ruler_suite(config: EngineConfig, spec: RulerSpec, policies: list[str] | None = None,
                progress: bool = True) -> dict:
    """Every task at every length for every (policy, ratio); every argument is checked before
    the model loads."""
    from kvreplay.models.loader import load_tokenizer, read_model_config
    runs = plan_runs(policies or default_policies(), spec.ratios)
    model_config = read_model_config(config.model)
    spec.check_context(config.max_model_len or model_config.max_position_embeddings)
    tokenizer = load_tokenizer(config.model, config.chat_template)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{config.model or 'the model'} has no chat template (a base model?): the suite frames "
                         "its prompts with one; pass --chat-template plain (plain text, RULER's setting for "
                         "base models) or a template file")
    kit = TextKit(tokenizer)
    cases = make_cases(kit, spec)
    memory = pool_bytes(spec, model_config, config.torch_dtype, config.block_size, config.watermark_levels.low)
    base = replace(config, kv_cache_memory=memory, enable_prefix_caching=False,
                   max_num_seqs=min(spec.cases, spec.concurrent))
    result = {"kind": "quality", "suite": "ruler", "environment": environment(), "spec": asdict(spec),
              "engine": {k: v for k, v in asdict(base).items() if k not in ("policy", "resident_ratio")},
              "runs": []}
    for policy, ratio in runs:
        name = label(policy, ratio)
        started = time.perf_counter()
        llm = make_llm(replace(base, policy=policy, resident_ratio=ratio))
        run = {"policy": policy, "ratio": ratio, "label": name,
               "load_s": time.perf_counter() - started, "tasks": {}}
        for length in spec.lengths:
            for task in spec.tasks:
                if progress:
                    print(f"ruler: {name}, {task}, {length} tokens, {spec.cases} cases", file=sys.stderr)
                if task == "multiturn":
                    cell = _run_multiturn(llm, kit, cases[(task, length)], progress)
                else:
                    cell = _run_task(llm, kit, cases[(task, length)], progress, spec.context_first,
                                     spec.concurrent)
                run["tasks"].setdefault(task, {})[str(length)] = cell
                if progress:
                    print(f"ruler: {name}, {task}, {length}: score {cell['score']:.1f} in "
                          f"{cell['wall_s']:.1f} s", file=sys.stderr)
        run["lengths"] = _summaries(run["tasks"], spec.lengths)
        run["over_ratio"] = over_ratio(run)
        if run["over_ratio"] and progress:
            print(f"ruler: warning: {name} kept more than its ratio resident at "
                  f"{', '.join(run['over_ratio'])} tokens (its knobs do not follow resident_ratio)",
                  file=sys.stderr)
        result["runs"].append(run)
        del llm
        gc.collect()
    return result

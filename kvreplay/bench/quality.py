"""`bench quality`: retrieval, fidelity and perplexity of each policy and budget (docs/architecture.md §8).

- Retrieval: a sentence "The secret number of <name> is <5 digits>." planted at a depth of a
  haystack cut from the Python docs (pydoc_data.topics), then asked for at the end; a case is
  right when the first number the model answers (greedy) is the planted one.
- Fidelity: the policy's greedy continuation of real text, teacher-forced under full attention on
  the same weights (scoring.compare_continuation): top-1 agreement, matching prefix, KL.
- Perplexity on long real text. Under `full` it is exact with full attention (FullAttentionScorer).
  Other policies need the engine to score given tokens under the policy (forced decoding); when the
  engine offers `engine.score(token_ids) -> [log p(t_i | t_<i)]` it is used, else the cell is empty.
"""
from __future__ import annotations

import gc
import math
import random
import re
from dataclasses import asdict, dataclass, replace

from kvreplay.bench.report import environment
from kvreplay.bench.scoring import FullAttentionScorer, compare_continuation
from kvreplay.bench.suite import check_policies, make_llm
from kvreplay.bench.workload import corpus_token_ids
from kvreplay.config import EngineConfig, parse_bytes

TASKS = ("retrieval", "fidelity", "perplexity")
NAMES = ("the blue door", "the old lighthouse", "the north tower", "the copper key", "the night train",
         "the glass garden", "the silver fox", "the river gate", "the paper moon", "the iron bridge")
ANSWER_TOKENS = 8


@dataclass(frozen=True)
class QualitySpec:
    tasks: tuple[str, ...] = TASKS
    lengths: tuple[int, ...] = (1024, 2048)
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    cases: int = 1
    fidelity_prompts: int = 4
    fidelity_context: int = 1024
    fidelity_tokens: int = 32
    ppl_tokens: int = 4096
    seed: int = 0

    def __post_init__(self):
        unknown = set(self.tasks) - set(TASKS)
        if unknown or not self.tasks:
            raise ValueError(f"unknown task(s) {sorted(unknown)}; choose from {', '.join(TASKS)}")
        if not all(0 <= d <= 1 for d in self.depths):
            raise ValueError(f"depths are fractions in [0, 1], got {self.depths}")
        if min(self.lengths) < 64 or self.cases < 1 or self.fidelity_tokens < 1 or self.ppl_tokens < 2:
            raise ValueError("lengths must be >= 64 tokens; cases, fidelity_tokens >= 1; ppl_tokens >= 2")


@dataclass
class RetrievalCase:
    length: int
    depth: float
    prompt_token_ids: list[int]
    answer: str


def retrieval_cases(tokenizer, corpus: list[int], spec: QualitySpec) -> list[RetrievalCase]:
    rng = random.Random(spec.seed)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    cases = []
    for length in spec.lengths:
        for depth in spec.depths:
            for _ in range(spec.cases):
                name, value = rng.choice(NAMES), str(rng.randrange(10_000, 100_000))
                needle = encode(f"\nThe secret number of {name} is {value}.\n")
                question = encode(f"\n\nQuestion: What is the secret number of {name}?\n"
                                  f"Answer: The secret number of {name} is")
                hay_tokens = length - len(needle) - len(question)
                if hay_tokens <= 0 or hay_tokens >= len(corpus):
                    raise ValueError(f"cannot build a {length}-token haystack")
                offset = rng.randrange(len(corpus) - hay_tokens)
                hay = corpus[offset:offset + hay_tokens]
                cut = round(depth * hay_tokens)
                cases.append(RetrievalCase(length, depth, hay[:cut] + needle + hay[cut:] + question, value))
    return cases


def generate_each(llm, prompts: list[list[int]], params, progress: bool, desc: str,
                  on_step=None) -> list:
    """Generate for each prompt; an output, or the error string for one the engine refused.
    `on_step(engine)` runs after every engine step."""
    from tqdm import tqdm
    engine = llm.engine
    results: list = [None] * len(prompts)
    ids = {}
    for i, prompt in enumerate(prompts):
        try:
            ids[engine.add_request(prompt, params, request_id=f"quality-{i}")] = i
        except ValueError as exc:
            results[i] = str(exc)
    bar = tqdm(total=len(ids), desc=desc, unit="req", disable=not progress, leave=False)
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    results[ids.pop(output.request_id)] = output
                    bar.update(1)
            if on_step is not None:
                on_step(engine)
    finally:
        bar.close()
        for request_id in ids:
            engine.abort_request(request_id)
    return results


def _measure_resident(engine, ratios: dict[str, list[float]]) -> None:
    """Each decoding request's resident KV (hot blocks + cold tier + key index) against the
    blocks `full` would hold for the same tokens, appended per request id."""
    kv = engine.kv
    for seq in engine.scheduler.running:
        if seq.num_uncomputed_tokens == 1:
            full_bytes = -(-seq.num_computed_tokens // kv.block_size) * kv.block_bytes
            ratios.setdefault(seq.request_id, []).append(kv.resident_bytes(seq.seq_id) / full_bytes)


def _resident_summary(ratios: dict[str, list[float]]) -> dict:
    seen = [values for values in ratios.values() if values]
    if not seen:
        return {"resident_first": None, "resident_mean": None, "resident_max": None}
    return {"resident_first": sum(v[0] for v in seen) / len(seen),
            "resident_mean": sum(sum(v) / len(v) for v in seen) / len(seen),
            "resident_max": max(max(v) for v in seen)}


def run_retrieval(llm, cases: list[RetrievalCase], progress: bool) -> dict:
    from kvreplay.sampling import SamplingParams
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0)
    ratios: dict[str, list[float]] = {}
    outputs = generate_each(llm, [c.prompt_token_ids for c in cases], params, progress, "retrieval",
                            on_step=lambda engine: _measure_resident(engine, ratios))
    rows = []
    for i, (case, output) in enumerate(zip(cases, outputs)):
        refused = isinstance(output, str)
        found = None if refused else re.search(r"\d+", output.text)
        seen = ratios.get(f"quality-{i}", [])
        rows.append({"length": case.length, "depth": case.depth, "answer": case.answer,
                     "output": output if refused else output.text,
                     "correct": bool(found and found.group() == case.answer), "refused": refused,
                     "resident_first": seen[0] if seen else None,
                     "resident_mean": sum(seen) / len(seen) if seen else None,
                     "resident_max": max(seen) if seen else None,
                     "stats": None if refused else output.outputs[0].stats.as_dict()})
    grid: dict[str, dict[str, float]] = {}
    for length in sorted({r["length"] for r in rows}):
        for depth in sorted({r["depth"] for r in rows}):
            cell = [r["correct"] for r in rows if r["length"] == length and r["depth"] == depth]
            grid.setdefault(str(length), {})[f"{depth:g}"] = sum(cell) / len(cell)
    measured = [r for r in rows if r["resident_mean"] is not None]

    def mean(key):
        return sum(r[key] for r in measured) / len(measured) if measured else None

    return {"accuracy": sum(r["correct"] for r in rows) / len(rows), "num_cases": len(rows),
            "resident_first": mean("resident_first"), "resident_mean": mean("resident_mean"),
            "resident_max": max((r["resident_max"] for r in measured), default=None),
            "replays": sum(r["stats"]["replays"] for r in rows if r["stats"]),
            "num_refused": sum(r["refused"] for r in rows), "grid": grid, "cases": rows}


def run_fidelity(llm, scorer: FullAttentionScorer, corpus: list[int], spec: QualitySpec,
                 progress: bool) -> dict:
    from kvreplay.sampling import MAX_LOGPROBS, SamplingParams
    rng = random.Random(spec.seed + 1)
    context = spec.fidelity_context
    prompts = [corpus[o:o + context] for o in (rng.randrange(len(corpus) - context)
                                                for _ in range(spec.fidelity_prompts))]
    params = SamplingParams(max_tokens=spec.fidelity_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=MAX_LOGPROBS)
    ratios: dict[str, list[float]] = {}
    outputs = generate_each(llm, prompts, params, progress, "fidelity",
                            on_step=lambda engine: _measure_resident(engine, ratios))
    per_prompt = []
    for prompt, output in zip(prompts, outputs):
        if isinstance(output, str):
            per_prompt.append({"refused": output})
            continue
        tokens = list(output.token_ids)
        sequence = prompt + tokens[:-1]
        reference = scorer.logprobs_at(sequence, list(range(len(prompt) - 1, len(sequence))))
        per_prompt.append(compare_continuation(reference, tokens, output.logprobs))
    scored = [p for p in per_prompt if "refused" not in p]

    def mean(key):
        values = [p[key] for p in scored if p[key] is not None]
        return sum(values) / len(values) if values else None

    return {"top1_agreement": mean("top1_agreement"), "matching_prefix": mean("matching_prefix"),
            "kl": mean("kl"), "num_prompts": len(prompts), "num_refused": len(prompts) - len(scored),
            "approx_tokens": sum(o.outputs[0].stats.approx_tokens for o in outputs if not isinstance(o, str)),
            **_resident_summary(ratios), "prompts": per_prompt}


def run_perplexity(llm, scorer: FullAttentionScorer, corpus: list[int], spec: QualitySpec,
                   policy: str) -> dict:
    ids = corpus[:spec.ppl_tokens]
    score = getattr(llm.engine, "score", None)
    if callable(score):
        logprobs = score(ids)
        return {"perplexity": math.exp(-sum(logprobs) / len(logprobs)), "tokens": len(ids), "method": "engine.score"}
    if policy == "full":
        return {"perplexity": scorer.perplexity(ids), "tokens": len(ids), "method": "full attention"}
    return {"perplexity": None, "tokens": len(ids),
            "method": "unavailable: the engine has no score() for this policy yet"}


def quality_suite(config: EngineConfig, spec: QualitySpec, policies: list[str], budgets: list[str],
                  progress: bool = True) -> dict:
    """Every task for every (policy, budget), each against full attention on the same weights."""
    runs = [(c, b) for c in check_policies(config, policies) for b in budgets]
    for _, budget in runs:
        parse_bytes(budget)
    result = {"kind": "quality", "environment": environment(), "spec": asdict(spec),
              "engine": {k: v for k, v in asdict(config).items() if k not in ("policy", "kv_cache_memory")},
              "runs": []}
    corpus = cases = None
    for policy_config, budget in runs:
        llm = make_llm(replace(policy_config, kv_cache_memory=budget))
        if corpus is None:
            corpus = corpus_token_ids(llm.tokenizer)
            cases = retrieval_cases(llm.tokenizer, corpus, spec) if "retrieval" in spec.tasks else []
        scorer = FullAttentionScorer(llm.engine.model)
        bytes_per_token = llm.engine.kv_bytes_per_token
        budget_bytes = llm.engine.kv.num_blocks * llm.engine.kv.block_size * bytes_per_token
        run = {"policy": policy_config.policy, "budget": budget, "budget_bytes": budget_bytes,
               "memory_ratio": {str(n): budget_bytes / ((n + ANSWER_TOKENS) * bytes_per_token)
                                for n in spec.lengths}}
        if "retrieval" in spec.tasks:
            run["retrieval"] = run_retrieval(llm, cases, progress)
        if "fidelity" in spec.tasks:
            run["fidelity"] = run_fidelity(llm, scorer, corpus, spec, progress)
        if "perplexity" in spec.tasks:
            run["perplexity"] = run_perplexity(llm, scorer, corpus, spec, policy_config.policy)
        result["runs"].append(run)
        del llm, scorer
        gc.collect()
    return result

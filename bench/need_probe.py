"""How the need detector's estimate separates a needed dropped range from an unneeded one.

For each case the prompt's middle is dropped right after prefill (policy="replay", trim="prefill")
and the detector runs at every decode step with a threshold of 1 (it never fires), so the largest
estimated single-block share of any head's attention can be read off each step:

- planted: a retrieval prompt (a number planted at 10%..80% depth of a pydoc haystack, asked for
  at the end); the steps that must copy the number should score high.
- ordinary: a continuation of plain pydoc text; no step should need the middle.

The first answer step matters most: the first answer token comes from the prefill (exact), the
next one is the first the detector sees. The printout gives, per statistic, the lowest value on a
planted first answer step and how many ordinary-text steps reach it (false alarms at that
threshold).

Usage:
    python bench/need_probe.py [--length 4096] [--cases 8] [--steps 4] [--dtype bfloat16]
                               [--window-tokens 256] [--top-blocks 8] [--seed 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics

from kvreplay import LLM, SamplingParams
from kvreplay.bench.quality import QualitySpec, retrieval_cases
from kvreplay.bench.workload import corpus_token_ids


def step_masses(llm: LLM, prompt: list[int], steps: int) -> tuple[list[float], list[float]]:
    """Per decode step: the detector's statistic (largest estimated single-block share of any
    head's attention), and an alternative (largest share of a block among the scored dropped
    blocks, times the square root of the head's dropped share), from the key index's trace."""
    engine = llm.engine
    index = engine.kv.key_index
    masses: list[float] = []
    index.trace = []
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    alternative = []
    run = engine.runner.run

    def recording_run(batch, greedy=False):  # the detector's statistic is in each step's result
        result = run(batch, greedy=greedy)
        masses.extend(outcome.mass for outcome in result.needs)
        return result
    engine.runner.run = recording_run
    while engine.has_unfinished_requests():
        index.trace.clear()
        engine.step()
        if index.trace:
            alternative.append(max(float((within * dropped.sqrt()).max())
                                   for _, within, dropped, _ in index.trace))
    index.trace = None
    return masses, alternative


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--window-tokens", type=int, default=256)
    parser.add_argument("--top-blocks", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    llm = LLM(dtype=args.dtype, kv_cache_memory="512MiB", policy="replay", trim="prefill",
              window_tokens=args.window_tokens, replay_threshold=1.0, need_top_blocks=args.top_blocks,
              enable_prefix_caching=False)
    corpus = corpus_token_ids(llm.tokenizer)
    depths = tuple(round(0.1 + 0.7 * i / max(1, args.cases - 1), 2) for i in range(args.cases))
    cases = retrieval_cases(llm.tokenizer, corpus, QualitySpec(lengths=(args.length,), depths=depths,
                                                                   seed=args.seed))
    rows = []
    for i, case in enumerate(cases):
        planted, planted_alt = step_masses(llm, case.prompt_token_ids, args.steps)
        offset = 7000 + i * 1500
        ordinary, ordinary_alt = step_masses(llm, corpus[offset:offset + args.length], args.steps)
        rows.append({"depth": case.depth, "planted": planted, "ordinary": ordinary,
                     "planted_alt": planted_alt, "ordinary_alt": ordinary_alt})
        print(f"depth {case.depth:.2f}  planted {[round(m, 2) for m in planted]}  "
              f"ordinary {[round(m, 2) for m in ordinary]}", flush=True)
    for key, name in (("", "block share (the detector)"), ("_alt", "within-dropped share x sqrt(dropped share)")):
        planted_first = [r["planted" + key][0] for r in rows]
        ordinary_steps = [m for r in rows for m in r["ordinary" + key]]
        threshold = min(planted_first)
        print(f"{name}: planted first answer step min {threshold:.3f} median "
              f"{statistics.median(planted_first):.3f}; ordinary steps at or above that: "
              f"{sum(m >= threshold for m in ordinary_steps)}/{len(ordinary_steps)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

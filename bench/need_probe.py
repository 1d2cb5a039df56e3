"""How the need detector's estimate separates a needed dropped range from an unneeded one.

For each case the prompt's middle is dropped right after prefill (policy="replay", trim="prefill")
and the detector runs at every decode step with a threshold of 1 (it never fires), so the largest
estimated single-block share of any head's attention can be read off each step:

- planted: a retrieval prompt (a number planted at 10%..90% depth of a pydoc haystack, asked for
  at the end); the steps that must copy the number should score high.
- ordinary: a continuation of plain pydoc text; no step should need the middle.

Usage:
    python bench/need_probe.py [--length 2048] [--cases 10] [--steps 8] [--dtype float32]
                               [--window-tokens 256] [--top-blocks 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics

from kvreplay import LLM, SamplingParams
from kvreplay.bench.quality import QualitySpec, retrieval_cases
from kvreplay.bench.workload import corpus_token_ids


def step_masses(llm: LLM, prompt: list[int], steps: int) -> list[float]:
    engine = llm.engine
    masses: list[float] = []
    engine.add_request(prompt, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        masses.extend(engine.runner.probed_mass)
    return masses


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--cases", type=int, default=10)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--window-tokens", type=int, default=256)
    parser.add_argument("--top-blocks", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    llm = LLM(dtype=args.dtype, kv_cache_memory="512MiB", policy="replay", trim="prefill",
              window_tokens=args.window_tokens, replay_threshold=1.0, need_top_blocks=args.top_blocks,
              enable_prefix_caching=False)
    corpus = corpus_token_ids(llm.tokenizer)
    depths = tuple(round(0.1 + 0.8 * i / max(1, args.cases - 1), 2) for i in range(args.cases))
    cases = retrieval_cases(llm.tokenizer, corpus, QualitySpec(lengths=(args.length,), depths=depths))
    rows = []
    for i, case in enumerate(cases):
        planted = step_masses(llm, case.prompt_token_ids, args.steps)
        offset = 5000 + i * 997
        ordinary = step_masses(llm, corpus[offset:offset + args.length], args.steps)
        rows.append({"depth": case.depth, "planted": planted, "ordinary": ordinary})
        print(f"depth {case.depth:.2f}  planted max {max(planted):.3f} first {planted[0]:.3f}   "
              f"ordinary max {max(ordinary):.3f}", flush=True)
    planted_first = [r["planted"][0] for r in rows]
    ordinary_max = [max(r["ordinary"]) for r in rows]
    print(f"planted, first answer step: min {min(planted_first):.3f} median {statistics.median(planted_first):.3f}")
    print(f"ordinary, max over steps:   max {max(ordinary_max):.3f} median {statistics.median(ordinary_max):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

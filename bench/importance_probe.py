"""Where the importance signal ranks a planted fact's block right after the prompt's prefill.

For each retrieval case (kvreplay.bench.quality: a fact planted at a depth of a real-text
haystack, asked at the end), the prompt is prefilled under `replay` and the KV manager's
importance scores (kvreplay.kv.importance: block mass of the prompt's last queries, every
layer) rank its middle blocks; the rank of the best block holding the fact is printed (1 = the
most important). With `--heavy-tokens N`, a rank <= N / block_size means the fact stays hot.

    python bench/importance_probe.py --length 4096 --cases 4
"""
from __future__ import annotations

import argparse
import statistics

from kvreplay import LLM
from kvreplay.bench.quality import QualitySpec, retrieval_cases
from kvreplay.bench.workload import corpus_token_ids
from kvreplay.kv.policy import middle_block_range


def needle_blocks(tokenizer, case, block_size: int) -> set[int]:
    """Blocks holding the planted number's tokens."""
    digits = tokenizer(f" is {case.answer}.", add_special_tokens=False).input_ids[1:]
    ids = case.prompt_token_ids
    for start in range(len(ids) - len(digits)):
        if ids[start:start + len(digits)] == digits:
            return {p // block_size for p in range(start, start + len(digits))}
    raise ValueError("needle not found in the prompt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--cases", type=int, default=4, help="cases per depth (5 depths)")
    parser.add_argument("--window-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype, policy="replay", trim="pressure", window_tokens=args.window_tokens,
              kv_cache_memory="256MiB", enable_prefix_caching=False)
    engine, kv = llm.engine, llm.engine.kv
    spec = QualitySpec(tasks=("retrieval",), lengths=(args.length,), cases=args.cases)
    cases = retrieval_cases(llm.tokenizer, corpus_token_ids(llm.tokenizer), spec)
    ranks = []
    for case in cases:
        engine.add_request(case.prompt_token_ids, llm_params(), request_id="probe")
        seq = None
        while seq is None or seq.num_uncomputed_tokens > 1 or seq.num_computed_tokens == 0:
            engine.step()
            seq = engine.scheduler.running[0]
        middle = list(middle_block_range(seq.num_computed_tokens, seq.pinned_tokens,
                                         args.window_tokens, kv.block_size))
        scores = dict(zip(middle, kv.importance.scores(seq.seq_id, middle)))
        order = sorted(middle, key=lambda i: -scores[i])
        rank = min(order.index(b) + 1 for b in needle_blocks(llm.tokenizer, case, kv.block_size))
        ranks.append(rank)
        print(f"depth {case.depth:.1f}: needle block rank {rank:3d} of {len(middle)}")
        engine.abort_request("probe")
    print(f"median rank {statistics.median(ranks)}, within top 4: {sum(r <= 4 for r in ranks)}/{len(ranks)}, "
          f"top 8: {sum(r <= 8 for r in ranks)}/{len(ranks)}")


def llm_params():
    from kvreplay import SamplingParams
    return SamplingParams(max_tokens=2, temperature=0.0)


if __name__ == "__main__":
    main()

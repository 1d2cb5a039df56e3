"""Gemma 3's KV bytes per request in the engine: the hybrid pool (kv/local_groups.py) against the
planner's figures (`kvreplay plan`), at the end of a prompt's prefill.

For each context, one prompt of that many tokens (real text, kvreplay.bench.workload's corpus) is
prefilled in chunks and the pool's blocks in use are read right after its last chunk: the global
layers hold every block, the local layers the blocks the next query's window reads. Printed
beside them: the planner's hybrid figure (which counts a window's worst block alignment, 33
blocks of 16 at a 512-token window) and its every-layer-full figure (the pool with
`hybrid_kv=False`: every block x all 18 layers).

    python bench/hybrid_kv_bytes.py --contexts 4096,8192
"""
from __future__ import annotations

import argparse
import time

from kvreplay import LLM, SamplingParams
from kvreplay.bench.workload import corpus_token_ids
from kvreplay.models.loader import read_model_config
from kvreplay.planner import KVDims, plan


def measure(llm: LLM, token_ids: list[int]) -> dict:
    """Blocks per layer group and resident bytes right after the prefill of `token_ids`."""
    seen = {}

    def after_step(engine) -> None:
        for seq in engine.scheduler.running:
            if not seen and seq.num_computed_tokens >= len(token_ids):
                kv = engine.kv
                seen.update(bytes=(kv.num_used_blocks - kv.num_reserved_blocks) * kv.block_bytes,
                            groups=kv.local.blocks_by_group(), block_bytes=kv.block_bytes)
    started = time.perf_counter()
    llm.generate(token_ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), on_step=after_step)
    seen["seconds"] = time.perf_counter() - started
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--contexts", default="4096,8192",
                        help="prompt lengths in tokens, comma-separated (two under the model's context at most)")
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    llm = LLM(model=args.model, dtype="bfloat16", kv_cache_memory="1GiB", max_num_batched_tokens=args.chunk,
              enable_prefix_caching=False)
    dims = KVDims.from_model_config(read_model_config(args.model), args.model)
    corpus = corpus_token_ids(llm.tokenizer, max(contexts))
    print("| context | engine, hybrid | blocks (global / local) | bytes per token | planner hybrid | "
          "every layer full | less than full |")
    print("|---|---|---|---|---|---|---|")
    for context in contexts:
        seen = measure(llm, corpus[:context])
        planned = plan(dims, context)
        groups = seen["groups"]
        print(f"| {context:,} | {seen['bytes'] / 1e6:.2f} MB | {groups['global']['used']} / "
              f"{groups.get('local', {}).get('used', 0)} | {seen['bytes'] / context:,.0f} | "
              f"{planned.hybrid_bytes / 1e6:.2f} MB | {planned.full_bytes / 1e6:.2f} MB | "
              f"{planned.full_bytes / seen['bytes']:.2f}x |  ({seen['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

"""Decode throughput with the decode products reading the GGUF file's Q4_1 / Q8_0 blocks
(quantized panels, expanded to bf16 as the kernel goes) and reading bf16 panels, side by side in
one process.

Usage: python bench/quant_panels.py [--batches 1,8,32] [--prompt-tokens 128] [--decode-tokens 32]
           [--rounds 4] [--threads 2]

For each batch: one engine on the embedded default model, one untimed warm-up, then --rounds
rounds that each time a full generation (as bench/engine_throughput.py clocks kvreplay: prefill,
then decode tokens/s) with every projection's quantized panels and then with the bf16 panels they
expand to (`expand_quant_panels`, the same weights: tests/test_quant_panels.py), which is what
KVREPLAY_QUANT_PANELS=0 gives at load. The greedy tokens of the two must match, and do.
Prints the medians, their ratio and the bytes of each form.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_throughput import _prompts, run_kvreplay  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.decode_tokens < 1:
        parser.error("--rounds and --decode-tokens must be at least 1")
    torch.set_num_threads(args.threads)
    from kvreplay import LLM
    from kvreplay.engine import cpu_kernels
    llm = LLM(dtype="bfloat16", kv_cache_memory="512MiB", max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    model = llm.engine.runner.model
    projections = [model.lm_head] + [layer[name] for layer in model.layers
                                     for name in ("qkv", "o", "gate_up", "down")]
    if any(p.panel_format == "bf16" for p in projections):
        print("not every projection has quantized panels here (no panel kernel, a model without "
              "Q4_1/Q8_0 blocks, or KVREPLAY_QUANT_PANELS=0)")
        return 1
    ops = cpu_kernels.layer_ops()
    panels = {"quant": [p.panels for p in projections],
              "bf16": [ops.expand_quant_panels(p.panels) for p in projections]}
    for form, tensors in panels.items():
        print(f"{form} panels: {sum(t.numel() * t.element_size() for t in tensors) / 1e6:.1f} MB")

    def use(form: str) -> None:
        for projection, tensor in zip(projections, panels[form]):
            projection.panels = tensor

    print("| batch | quantized panels decode tok/s | bf16 panels decode tok/s | ratio |")
    print("|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = _prompts(llm.tokenizer, batch, args.prompt_tokens)
        run_kvreplay(llm, prompts, 2)  # warm-up
        rates = {"quant": [], "bf16": []}
        tokens = {}
        for _ in range(args.rounds):
            for form in rates:
                use(form)
                rates[form].append(run_kvreplay(llm, prompts, args.decode_tokens)[1])
                tokens[form] = [o.token_ids for o in llm.generate(prompts[:2], _greedy(8))]
        use("quant")
        if tokens["quant"] != tokens["bf16"]:
            print(f"batch {batch}: the two forms gave different greedy tokens", file=sys.stderr)
            return 1
        a, b = statistics.median(rates["quant"]), statistics.median(rates["bf16"])
        print(f"| {batch} | {a:.1f} | {b:.1f} | {a / b:.2f}x |", flush=True)
    return 0


def _greedy(max_tokens: int):
    from kvreplay import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


if __name__ == "__main__":
    sys.exit(main())

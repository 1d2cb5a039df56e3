"""Decode throughput with the decode products reading the GGUF file's Q4_1 / Q8_0 blocks
(quantized panels, expanded to bf16 as the kernel goes) and reading bf16 panels, side by side in
one process.

Usage: python bench/quant_panels.py [--batches 1,8,32] [--prompt-tokens 128] [--decode-tokens 32]
           [--rounds 4] [--threads 2]

For each batch: one engine on the embedded default model, one untimed warm-up, then --rounds
rounds that each time a full generation (as `kvreplay bench throughput` clocks kvreplay: prefill,
then decode tokens/s) with every projection's quantized panels and then with the bf16 panels they
expand to (`expand_quant_panels`, the same weights: tests/test_quant_panels.py), which is what
KVREPLAY_QUANT_PANELS=0 gives at load. The greedy tokens of the two must match, and do.
Prints the medians, their ratio and the bytes of each form.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alternating import bf16_engine, compare, panel_forms, parse_args  # noqa: E402


def main(argv=None) -> int:
    args = parse_args(__doc__.split("\n\n")[0], argv)
    # the blocks even where they are not the default (an AVX2-only CPU: bf16 panels there)
    os.environ.setdefault("KVREPLAY_QUANT_PANELS", "1")
    from kvreplay.kernels import cpu_kernels
    llm = bf16_engine()
    model = llm.engine.runner.model
    projections = [model.lm_head] + [layer[name] for layer in model.layers
                                     for name in ("qkv", "o", "gate_up", "down")]
    if any(p.panel_format == "bf16" for p in projections):
        print("not every projection has quantized panels here (no panel kernel, a model without "
              "Q4_0/Q4_1/Q8_0 blocks, or KVREPLAY_QUANT_PANELS=0)")
        return 1
    ops = cpu_kernels.layer_ops()
    panels = {"blocks": [p.panels for p in projections],
              "bf16 panels": [ops.expand_quant_panels(p.panels) for p in projections]}
    return compare(llm, args, panel_forms(model, projections, panels), same_tokens=True)


if __name__ == "__main__":
    sys.exit(main())

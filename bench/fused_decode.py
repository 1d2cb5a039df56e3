"""Decode throughput with and without decode_layer (one compiled call per decoder layer), side by
side in one process.

Usage: python bench/fused_decode.py [--batches 1,8,32] [--prompt-tokens 128] [--decode-tokens 32]
           [--rounds 4] [--threads 2]

For each batch: one engine, one untimed warm-up, then --rounds rounds that each time a full
generation (as `kvreplay bench throughput` clocks kvreplay: prefill, then decode tokens/s) with the
fused layers and then without them (`LlamaModel.fused_rows` set to 0, which is what
KVREPLAY_FUSED_DECODE=0 does at load). Alternating in one process keeps the machine's drift out of
the ratio; separate processes minutes apart differ by more than the effect on a shared machine.
Prints the medians and their ratio.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alternating import bf16_engine, compare, parse_args  # noqa: E402


def main(argv=None) -> int:
    args = parse_args(__doc__.split("\n\n")[0], argv)
    llm = bf16_engine()
    model = llm.engine.runner.model
    fused = list(model.fused_rows)
    if not any(fused):
        print("decode_layer does not apply here (no layer ops, no panel kernel, or KVREPLAY_FUSED_DECODE=0)")
        return 1

    def rows(value):
        def apply():
            model.fused_rows = value
        return apply
    return compare(llm, args, {"fused decode": rows(fused), "layer code": rows([0] * len(fused))})


if __name__ == "__main__":
    sys.exit(main())

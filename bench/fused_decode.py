"""Decode throughput of the compiled decode paths against what they replace, side by side in one
process.

Usage: python bench/fused_decode.py [--compare layers|stack|greedy] [--batches 1,8,32]
           [--prompt-tokens 128] [--decode-tokens 32] [--rounds 4] [--threads 2]

--compare layers (default): decode_layer(s) (the decoder layers as compiled calls) against the
    Python layer code (`LlamaModel.fused_rows` set to 0, which is what KVREPLAY_FUSED_DECODE=0
    does at load).
--compare stack: decode_layers (the whole stack in one call, one set of buffers) against
    decode_layer called layer by layer from Python.
--compare greedy: the greedy LM head (panel_argmax: each row's argmax, no logits stored) against
    the logits and the sampler's argmax.

For each batch: one engine, one untimed warm-up, then --rounds rounds that each time a full
generation (as `kvreplay bench throughput` clocks kvreplay: prefill, then decode tokens/s) with
the first setting and then the second, and check that both give the same greedy tokens.
Alternating in one process keeps the machine's drift out of the ratio; separate processes minutes
apart differ by more than the effect on a shared machine. Prints the medians and their ratio.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alternating import bf16_engine, compare, parse_args  # noqa: E402

COMPARISONS = ("layers", "stack", "greedy")


def main(argv=None) -> int:
    args = parse_args(__doc__.split("\n\n")[0], argv, extra={
        "--compare": dict(choices=COMPARISONS, default="layers", help="which pair of paths (see above)")})
    llm = bf16_engine()
    engine = llm.engine
    model = engine.runner.model
    fused = list(model.fused_rows)
    if not any(fused):
        print("decode_layer does not apply here (no layer ops, no panel kernel, or KVREPLAY_FUSED_DECODE=0)")
        return 1

    def rows(value):
        def apply():
            model.fused_rows = value
        return apply

    def per_layer(delta, cos, sin, kv_caches, meta):
        residual = None
        for index, kv_cache in enumerate(kv_caches):
            delta, residual = model.decode_layer(index, delta, residual, cos, sin, kv_cache, meta)
        return delta, residual

    def instance(owner, name, value):  # None: the class's own method again
        def apply():
            if value is None:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, value)
        return apply

    if args.compare == "layers":
        settings = {"fused decode": rows(fused), "layer code": rows([0] * len(fused))}
    elif args.compare == "stack":
        settings = {"decode_layers": instance(model, "decode_layers", None),
                    "decode_layer each": instance(model, "decode_layers", per_layer)}
    else:
        settings = {"argmax head": instance(engine, "_argmax_only", None),
                    "logits": instance(engine, "_argmax_only", lambda batch: False)}
    return compare(llm, args, settings, same_tokens=True)


if __name__ == "__main__":
    sys.exit(main())

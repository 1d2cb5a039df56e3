"""Integer products (the AVX2 kernel's: the products read the GGUF file's blocks as integers, x as
16-bit integers here, KVREPLAY_INT_PRODUCTS=1) against the bf16 panels (KVREPLAY_INT_PRODUCTS=0),
side by side in one process: decode and prefill speed, and fidelity to the fp32 model (the
exactness reference) on real text.

Usage: python bench/int_products.py [--x-bits 16|8] [--batches 1,32] [--prompt-tokens 128]
           [--decode-tokens 32] [--rounds 4] [--threads 2] [--text-tokens 1024] [--skip-speed]
           [--skip-quality]

--x-bits 8: x at 8 bits for the Q4 blocks (KVREPLAY_INT_PRODUCTS=8, lossy; the engine's default
on the AVX2 kernel), 16 for the Q8_0 LM head. Speed: one bf16 engine loaded with integer
records, its bf16 panels packed from the same projections' bf16 weights (moved onto 2 MiB pages
as the loaded ones are); generations alternate between the two (bench/alternating.py).
Quality: the logits at every position of --text-tokens tokens of real text (the Python docs), in
chunks of 512 through the paged cache, from the fp32 engine and from the bf16 engine with each
form: top-1 agreement with fp32, mean and largest |logit difference|, and each one's perplexity.
Needs an AVX2 build of the panel kernel (has_int_products).
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alternating import bf16_engine, compare, panel_forms, parse_args  # noqa: E402

CHUNK = 512


def _logits(model, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits at every position, prefilled CHUNK tokens at a time through a fresh cache."""
    from kvreplay.layers.attention import AttentionMetadata, PrefillSlice
    from kvreplay.kv import KVManager
    cfg, block_size = model.config, 16
    num_blocks = -(-len(token_ids) // block_size)
    kv = KVManager(num_blocks, block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device)
    table = torch.arange(num_blocks)
    pieces = []
    with torch.no_grad():
        for start in range(0, len(token_ids), CHUNK):
            end = min(start + CHUNK, len(token_ids))
            positions = torch.arange(start, end)
            mask = None if start == 0 else torch.arange(end)[None, :] <= positions[:, None]
            meta = AttentionMetadata(slot_mapping=positions, prefills=[PrefillSlice(0, end - start, end, table, mask)])
            pieces.append(model.forward(torch.tensor(token_ids[start:end]), positions, kv.kv_caches, meta, None).float())
    return torch.cat(pieces)


def _perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    targets = torch.tensor(token_ids[1:])
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1], targets).item())


def main(argv=None) -> int:
    extra = {"--x-bits": {"type": int, "choices": (16, 8), "default": 16},
             "--text-tokens": {"type": int, "default": 1024},
             "--skip-speed": {"action": "store_true"}, "--skip-quality": {"action": "store_true"}}
    args = parse_args(__doc__.split("\n\n")[0], argv, extra)
    if args.text_tokens < 2:
        print("--text-tokens must be at least 2", file=sys.stderr)
        return 2
    from kvreplay.kernels import cpu_kernels
    from kvreplay.layers.linear import onto_huge_pages
    ops = cpu_kernels.layer_ops()
    if ops is None or not ops.has_panel_linear() or not ops.has_int_products():
        print("this build of the panel kernel has no integer products (they run on its AVX2 build)")
        return 1
    os.environ["KVREPLAY_INT_PRODUCTS"] = str(args.x_bits)
    llm = bf16_engine()
    model = llm.engine.runner.model
    projections = [model.lm_head] + [layer[name] for layer in model.layers
                                     for name in ("qkv", "o", "gate_up", "down")]
    if not all("/int" in p.panel_format for p in projections):
        print("not every projection has integer records here (a model without Q4_0/Q4_1/Q8_0 blocks?)")
        return 1
    label = "integer products" + (", 8-bit x" if args.x_bits == 8 else "")
    records = [p.panels for p in projections]
    # the bf16 panels on 2 MiB pages too, as the engine keeps the panels it loads (a step that
    # streams them from 4 KiB pages runs slower at batch 1: the comparison would favour the records)
    for projection in projections:
        weight = projection.weight if projection.panel_order is None else projection.weight[projection.panel_order]
        projection.panels = ops.pack_panels(weight)
    onto_huge_pages(projections)
    panels = {label: records, "bf16 panels": [p.panels for p in projections]}
    forms = panel_forms(model, projections, panels)
    status = 0 if args.skip_speed else compare(llm, args, forms)
    if args.skip_quality:
        return status
    from pydoc_data.topics import topics
    ids = llm.tokenizer("\n".join(topics[k] for k in sorted(topics))).input_ids[:args.text_tokens]
    from kvreplay import LLM
    reference = _logits(LLM(dtype="float32", kv_cache_memory="64MiB").engine.runner.model, ids)
    print(f"\n{len(ids)} tokens of text; fp32 perplexity {_perplexity(reference, ids):.3f}\n")
    print("| form | top-1 = fp32's | mean abs logit diff | largest | perplexity |")
    print("|---|---|---|---|---|")
    for form in panels:
        forms[form]()
        logits = _logits(model, ids)
        diff = (logits - reference).abs()
        agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        print(f"| {form} | {100 * agree:.2f}% | {diff.mean().item():.4f} | {diff.max().item():.3f} | "
              f"{_perplexity(logits, ids):.3f} |", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

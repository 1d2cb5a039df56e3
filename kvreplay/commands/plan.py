"""`kvreplay plan`: how many requests of length T fit a KV budget, under each policy."""
from __future__ import annotations

import argparse
import json
import sys

from kvreplay import planner


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="KV bytes per token/request and max concurrency per policy",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Plan KV-cache capacity from a local model (GGUF, HF directory, config.json) "
                    "or explicit dimensions. No weights are loaded.\n\n" + planner.__doc__,
        epilog="examples:\n"
               "  kvreplay plan --context 8192 --budget 256MiB\n"
               "  kvreplay plan --num-layers 32 --num-kv-heads 8 --head-dim 128 --context 131072 --budget 50GB\n"
               "  kvreplay plan --num-layers 80 --hidden-size 8192 --kv-dtype fp16 --context 8192 --budget 40GB")
    model = parser.add_argument_group("model (a path, or dimensions)")
    model.add_argument("--model", default=None,
                       help="a .gguf file, HF model directory or config.json (default: the embedded "
                            "SmolLM2-135M-Instruct)")
    model.add_argument("--num-layers", type=int, help="transformer layers")
    model.add_argument("--num-kv-heads", type=int, help="K/V heads per layer (GQA/MQA)")
    model.add_argument("--head-dim", type=int, help="dimension of one head")
    model.add_argument("--hidden-size", type=int,
                       help="hidden size: with --num-heads derives the head dim; alone means MHA")
    model.add_argument("--num-heads", type=int, help="query heads (with --hidden-size)")
    what = parser.add_argument_group("what to plan")
    what.add_argument("--context", type=_int_list, default=None,
                      help="context lengths in tokens, comma-separated (default: 1024, 8192 and "
                           "the model's context)")
    what.add_argument("--budget", default=None,
                      help="KV budget for the concurrency column, e.g. 256MiB or 40GB")
    what.add_argument("--policies", default=",".join(planner.DEFAULT_POLICIES),
                      help="comma-separated, cold dtype as a suffix (default: %(default)s; also "
                           "replay+cold:int8, and snapkv, h2o, quest with --resident-ratio)")
    what.add_argument("--tier-memory", default=None,
                      help="session tier host memory (kv_tier_memory), e.g. 8GiB: sessions it holds")
    what.add_argument("--tier-disk", default=None,
                      help="session tier disk budget (kv_tier_disk), e.g. 200GB: sessions it holds")
    knobs = parser.add_argument_group("knobs")
    defaults = planner.PlanKnobs()
    knobs.add_argument("--kv-dtype", default=defaults.kv_dtype, choices=sorted(planner.KV_DTYPE_BYTES),
                       help="dtype of hot KV (default: %(default)s)")
    knobs.add_argument("--block-size", type=int, default=defaults.block_size,
                       help="tokens per block (default: %(default)s)")
    knobs.add_argument("--sink-tokens", type=int, default=defaults.sink_tokens, help="(default: %(default)s)")
    knobs.add_argument("--window-tokens", type=int, default=defaults.window_tokens,
                       help="(default: %(default)s)")
    knobs.add_argument("--protected-tokens", type=int, default=defaults.protected_tokens,
                       help="system prompt / pinned tokens per request (default: %(default)s)")
    knobs.add_argument("--resident-ratio", type=float, default=None,
                       help="share of full's KV that snapkv, h2o and quest keep (they need it)")
    knobs.add_argument("--index-bits", type=int, default=defaults.index_bits, choices=planner.INDEX_BITS,
                       help="bits of the replay key index (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=run_plan)


def dims_from_args(args) -> planner.KVDims:
    explicit = [args.num_layers, args.num_kv_heads, args.head_dim, args.hidden_size, args.num_heads]
    if not any(v is not None for v in explicit):
        from kvreplay.models.loader import read_model_config, resolve_model_path
        path = resolve_model_path(args.model)
        return planner.KVDims.from_model_config(read_model_config(path), path)
    if args.model is not None:
        raise ValueError("give either --model or dimensions, not both")
    if args.num_layers is None:
        raise ValueError("explicit dimensions need --num-layers")
    if args.hidden_size is not None:
        if args.head_dim is not None:
            raise ValueError("give --head-dim or --hidden-size, not both")
        return planner.KVDims.from_hidden(args.num_layers, args.hidden_size, args.num_heads,
                                          args.num_kv_heads)
    if args.num_kv_heads is None or args.head_dim is None:
        raise ValueError("explicit dimensions need --num-kv-heads and --head-dim (or --hidden-size)")
    return planner.KVDims(args.num_layers, args.num_kv_heads, args.head_dim, args.num_heads)


def run_plan(args) -> int:
    from kvreplay.validate import parse_bytes
    dims = dims_from_args(args)
    named_model = args.model is not None or not any(v is not None for v in (args.num_layers, args.hidden_size))
    knobs_line, index_layers = auto_replay_knobs(dims.source, args.block_size, args.resident_ratio) \
        if named_model else ("", None)
    knobs = planner.PlanKnobs(args.block_size, args.sink_tokens, args.window_tokens, args.protected_tokens,
                              args.kv_dtype, args.index_bits, args.resident_ratio, index_layers)
    budget = parse_bytes(args.budget) if args.budget else None
    contexts = args.context or sorted({1024, 8192, dims.max_context_tokens or 8192})
    policies = [p for p in args.policies.split(",") if p.strip()]
    tier = [parse_bytes(value) if value else 0 for value in (args.tier_memory, args.tier_disk)]
    plans = [planner.plan(dims, t, knobs, budget, policies, *tier) for t in contexts]
    if args.json:
        json.dump({"model": asdict_dims(dims), "knobs": knobs.__dict__, "plans": [p.as_dict() for p in plans]},
                  sys.stdout, indent=2)
        print()
        return 0
    print(render(dims, knobs, plans))
    if dims.num_local_layers:  # the engine's refusals: engine/model_setup.py
        print("\nthe engine serves this sliding-window model through its hybrid pool under "
              f"{', '.join(planner.HYBRID_POLICIES)}, acting on its global layers only (the rows count "
              "every layer's blocks; the hybrid lines what the engine holds), replay and replay+cold "
              "recomputing the whole sequence when they replay")
    if named_model:
        print("\n" + knobs_line)
    return 0


def auto_replay_knobs(source: str, block_size: int, ratio: float | None = None) -> tuple[str, int | None]:
    """What `need_layers`, `heavy_tokens` and `replay_threshold` = "auto" resolve to for this
    model (bf16), and under `ratio` whether the need detector's key index fits the budget; with
    the number of layers replay's key index keeps (None: not calibrated yet, planned as all)."""
    from kvreplay.engine.calibration import index_crowds_budget, lookup, sliding_window_defaults
    from kvreplay.models.loader import read_model_config
    config = read_model_config(source)
    found = sliding_window_defaults(config, block_size) or lookup(source, block_size=block_size)
    if found is None:
        return ("replay knobs (need_layers, heavy_tokens, replay_threshold = auto): not calibrated yet "
                "for this model and block size; the first replay engine to load it runs the pass "
                "(six 1,024-token prefills) and caches the result; replay's rows count a key index "
                "of every layer"), None
    line = f"replay knobs (need_layers, heavy_tokens, replay_threshold = auto): {found.describe()}"
    crowded = index_crowds_budget(config, found.need_layers, block_size, ratio)
    if crowded:
        return line + f"; at resident_ratio {ratio:g}, need_layers none: {crowded}", 0
    return line, len(found.need_layers)


def asdict_dims(dims: planner.KVDims) -> dict:
    return {**dims.__dict__, "bytes_per_token_bf16": dims.bytes_per_token(2)}


def render(dims: planner.KVDims, knobs: planner.PlanKnobs, plans: list[planner.RequestPlan]) -> str:
    """Plain-text report: one header, one table per context length."""
    fmt = planner.format_bytes
    heads = f"{dims.num_kv_heads} KV heads x {dims.head_dim}"
    if dims.num_heads:
        heads += f", {dims.num_heads} query heads ({dims.num_heads // dims.num_kv_heads}:1)"
    first = plans[0]
    lines = [f"model: {dims.source}",
             f"       {dims.num_layers} layers, {heads}"
             + (f", context {dims.max_context_tokens:,}" if dims.max_context_tokens else ""),
             f"KV {knobs.kv_dtype}: {first.bytes_per_token:,} bytes per token ({fmt(first.bytes_per_token)}); "
             f"block of {knobs.block_size} tokens = {first.block_bytes:,} bytes",
             f"zones: {knobs.sink_tokens} sinks, {knobs.protected_tokens} protected, "
             f"{knobs.window_tokens}-token window; replay index int{knobs.index_bits}"]
    if dims.num_local_layers:
        lines.append("layer groups: " + "; ".join(
            f"{g['name']} {g['num_layers']} layers " + (f"(window {g['window_tokens']:,}) " if g["window_tokens"] else "")
            + f"{g['bytes_per_token']:,} bytes per token" for g in first.layer_groups))
    if first.budget_bytes:
        lines.append(f"budget: {fmt(first.budget_bytes)}")
    for request in plans:
        lines += ["", f"context {request.context_tokens:,} tokens: {request.num_blocks:,} blocks, "
                      f"rounding waste {request.waste_tokens} tokens; full KV {request.full_bytes:,} bytes "
                      f"= {fmt(request.full_bytes)}"]
        header = f"  {'policy':<18}{'hot blk':>8}{'middle':>16}  {'resident/request':<30}{'vs full':>8}"
        if request.budget_bytes:
            header += f"{'max concurrent':>16}"
        lines.append(header)
        for p in request.policies:
            middle = f"{p.middle_blocks} {p.middle_state}" if p.middle_blocks else "-"
            row = (f"  {p.policy:<18}{p.hot_blocks:>8,}{middle:>16}  {fmt(p.resident_bytes):<30}"
                   f"{p.resident_bytes / request.full_bytes:>7.3f}x")
            if p.max_concurrency is not None:
                row += f"{p.max_concurrency:>16,}" if p.max_concurrency else f"{'0 (too big)':>16}"
            lines.append(row)
        if dims.num_local_layers:
            lines.append(f"  hybrid pool (the engine's, hybrid_kv: local layers keep their window): "
                         f"{fmt(request.hybrid_bytes)}, "
                         f"{request.hybrid_bytes / request.context_tokens:,.0f} bytes per token, "
                         f"{request.full_bytes / request.hybrid_bytes:.2f}x less than full")
            lines += [f"    {p.policy:<16}{fmt(p.hybrid_bytes):<30}{p.hybrid_bytes / request.full_bytes:>7.3f}x"
                      for p in request.policies if p.hybrid_bytes is not None and p.policy != "full"]
        if request.tier_sessions:
            held = "; ".join(f"{level} holds {count:,}" for level, count in request.tier_sessions.items())
            lines.append(f"  session tier (full blocks of this context per session): {held}")
    return "\n".join(lines)

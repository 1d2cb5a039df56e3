"""Shared by the benches that compare two settings of one engine side by side in one process
(bench/fused_decode.py, bench/quant_panels.py): generations with setting A and with setting B
alternate, so that the machine's drift stays out of the ratio (separate processes minutes apart
differ by more than the effects measured on a shared machine)."""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable

import torch

from kvreplay.bench.throughput import _prompts, run_kvreplay


def parse_args(description: str, argv=None, extra: dict | None = None) -> argparse.Namespace:
    """The shared options, plus `extra` ({flag: add_argument keywords}) of the calling bench."""
    parser = argparse.ArgumentParser(description=description)
    for flag, options in (extra or {}).items():
        parser.add_argument(flag, **options)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.decode_tokens < 1:
        parser.error("--rounds and --decode-tokens must be at least 1")
    torch.set_num_threads(args.threads)
    return args


def bf16_engine():
    """The embedded default model in bf16, as `kvreplay bench throughput` runs it."""
    from kvreplay import LLM
    return LLM(dtype="bfloat16", kv_cache_memory="512MiB", max_num_batched_tokens=2048,
               enable_prefix_caching=False)


def compare(llm, args: argparse.Namespace, settings: dict[str, Callable[[], None]],
            same_tokens: bool = False) -> int:
    """For each batch: one untimed warm-up, then --rounds rounds, each timing a full generation
    (prefill, then decode tokens/s as `kvreplay bench throughput` clocks kvreplay) under each of
    the two `settings` (label -> function that applies it) in turn; prints a table row of the
    medians and their ratio, decode and then prefill (of --prompt-tokens a prompt). With
    `same_tokens`, the two settings must also give the same greedy tokens (returns 1 where they do
    not). The first setting is left applied."""
    first, second = settings
    print(f"| batch | {first}, decode tok/s | {second}, decode tok/s | ratio "
          f"| {first}, prefill tok/s | {second}, prefill tok/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = _prompts(llm.tokenizer, batch, args.prompt_tokens)
        run_kvreplay(llm, prompts, 2)  # warm-up
        rates = {label: [] for label in settings}
        prefills = {label: [] for label in settings}
        tokens = {}
        for _ in range(args.rounds):
            for label, apply in settings.items():
                apply()
                prefill, decode = run_kvreplay(llm, prompts, args.decode_tokens)
                rates[label].append(decode)
                prefills[label].append(prefill)
                if same_tokens:
                    tokens[label] = [o.token_ids for o in llm.generate(prompts[:2], _greedy(8))]
        settings[first]()
        if same_tokens and tokens[first] != tokens[second]:
            print(f"batch {batch}: {first} and {second} gave different greedy tokens", file=sys.stderr)
            return 1
        a, b = statistics.median(rates[first]), statistics.median(rates[second])
        pa, pb = statistics.median(prefills[first]), statistics.median(prefills[second])
        print(f"| {batch} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {pa:.1f} | {pb:.1f} | {pa / pb:.2f}x |", flush=True)
    return 0


def panel_forms(model, projections: list, panels: dict[str, list]) -> dict[str, Callable[[], None]]:
    """For each form of the panels (label -> one tensor per projection, in `projections`' order):
    a function that puts those tensors into the projections and decode_layers' list of them
    (`model.restack()`), for `compare`. Prints each form's bytes first."""
    for form, tensors in panels.items():
        print(f"{form}: {sum(t.numel() * t.element_size() for t in tensors) / 1e6:.1f} MB")

    def use(form: str):
        def apply():
            for projection, tensor in zip(projections, panels[form]):
                projection.panels = tensor
            model.restack()
        return apply
    return {form: use(form) for form in panels}


def _greedy(max_tokens: int):
    from kvreplay import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

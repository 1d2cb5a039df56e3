"""`kvreplay generate` (one-shot) and `kvreplay chat` (interactive)."""
from __future__ import annotations

import argparse
import json
import sys


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0: all")
    group.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling_params(args):
    from kvreplay.sampling import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=args.stop)


def register(subparsers) -> None:
    from kvreplay.commands.flags import add_engine_args
    gen = subparsers.add_parser("generate", help="generate a completion for a prompt",
                                description="Generate text for one or more prompts and print it.")
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--json", action="store_true", help="print JSON with tokens and KV counters")
    _add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=run_generate)

    chat = subparsers.add_parser("chat", help="interactive chat in the terminal",
                                 description="Chat with the model. Empty line or Ctrl-D quits; "
                                             "'/reset' clears the history.")
    chat.add_argument("--system", default=None, help="system message")
    _add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=run_chat, max_tokens=256)


def _make_llm(args):
    from kvreplay.api import LLM
    from kvreplay.commands.flags import engine_config_from_args
    config = engine_config_from_args(args)
    print(f"loading {config.model or 'the embedded SmolLM2-135M-Instruct'} ...", file=sys.stderr)
    return LLM(**{k: getattr(config, k) for k in config.__dataclass_fields__})


def run_generate(args) -> int:
    params = _sampling_params(args)
    llm = _make_llm(args)
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        outputs = llm.chat([system + [{"role": "user", "content": p}] for p in args.prompt], params,
                           use_tqdm=len(args.prompt) > 1)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1)
    for prompt, out in zip(args.prompt, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "kv": out.stats.as_dict()}))
        else:
            print(out.text if len(args.prompt) == 1 else f"### {prompt}\n{out.text}\n")
    return 0


def run_chat(args) -> int:
    params = _sampling_params(args)
    llm = _make_llm(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    base = list(history)
    print("kvreplay chat: empty line or Ctrl-D quits, /reset clears history", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            return 0
        if line.strip() == "/reset":
            history = list(base)
            continue
        history.append({"role": "user", "content": line})
        try:
            out = llm.chat(history, params)
        except ValueError as exc:  # e.g. the history outgrew the context
            print(f"error: {exc}", file=sys.stderr)
            history.pop()
            continue
        print(f"assistant> {out.text}")
        history.append({"role": "assistant", "content": out.text})

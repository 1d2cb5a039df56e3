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
                                description="Generate text for one or more prompts and print it: "
                                            "one prompt's text streams as it is made; several "
                                            "prompts (or --json) show a progress bar on stderr.")
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
    """The LLM the engine flags describe; it logs its loading and the startup summary."""
    from kvreplay.api import LLM
    from kvreplay.commands.flags import engine_config_from_args
    config = engine_config_from_args(args)
    return LLM(**{k: getattr(config, k) for k in config.__dataclass_fields__})


class _TextPrinter:
    """Writes a reply as it grows. Holds back what may still change: a trailing U+FFFD (a
    character whose bytes have not all been decoded yet) and a tail that could begin a stop
    string (the engine cuts the text before a stop string once all of it has come)."""

    def __init__(self, stop: list[str], out=None):
        self.stop, self.out = stop, out if out is not None else sys.stdout
        self.num_shown = 0

    def show(self, text: str, final: bool = False) -> None:
        if not final:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - max((k for s in self.stop for k in range(1, len(s))
                                          if text.endswith(s[:k])), default=0)]
        if len(text) > self.num_shown:
            self.out.write(text[self.num_shown:])
            self.out.flush()
            self.num_shown = len(text)


def _stream(outputs, printer: _TextPrinter):
    """Print each output's text as it grows; returns the last completion."""
    completion = None
    for output in outputs:
        completion = output.outputs[0]
        printer.show(completion.text, final=output.finished)
    return completion


def _cut_note(completion, max_tokens: int) -> str:
    """Why a reply ended early, or "" when it ended on its own."""
    if completion.finish_reason != "length":
        return ""
    if len(completion.token_ids) >= max_tokens:
        return f"[cut at --max-tokens {max_tokens}]"
    return "[cut: the context is full]"


def run_generate(args) -> int:
    params = _sampling_params(args)
    llm = _make_llm(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    if len(args.prompt) == 1 and not args.json:  # one prompt: its text streams as it is made
        prompt = args.prompt[0]
        outputs = (llm.chat_stream(system + [{"role": "user", "content": prompt}], params)
                   if args.chat else llm.stream(prompt, params))
        completion = _stream(outputs, _TextPrinter(params.stop))
        print()
        note = _cut_note(completion, params.max_tokens)
        if note:
            print(note, file=sys.stderr)
        return 0
    if args.chat:  # a progress bar on stderr counts requests and tokens
        outputs = llm.chat([system + [{"role": "user", "content": p}] for p in args.prompt], params,
                           use_tqdm=True)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=True)
    for prompt, out in zip(args.prompt, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "kv": out.stats.as_dict()}))
        else:
            print(f"### {prompt}\n{out.text}\n")
    return 0


def run_chat(args) -> int:
    params = _sampling_params(args)
    llm = _make_llm(args)
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    print("kvreplay chat: empty line or Ctrl-D quits, /reset clears the history, Ctrl-C stops a "
          "reply", file=sys.stderr)
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
            print("(history cleared" + ("; the system message stays)" if base else ")"))
            continue
        history.append({"role": "user", "content": line})
        try:
            outputs = llm.chat_stream(history, params)
        except ValueError as exc:  # e.g. the history outgrew the context
            print(f"error: {exc}", file=sys.stderr)
            history.pop()
            continue
        print("assistant> ", end="", flush=True)
        printer = _TextPrinter(params.stop)
        try:
            completion = _stream(outputs, printer)
            note = _cut_note(completion, params.max_tokens)
            text = completion.text
        except KeyboardInterrupt:  # stop this reply, keep the chat
            outputs.close()
            note, text = "[stopped]", None
        print(f" {note}" if note else "")
        if text is None:
            history.pop()
            continue
        history.append({"role": "assistant", "content": text})

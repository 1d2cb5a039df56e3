"""Structured output: how often JSON mode returns valid JSON, and what its per-token masking
costs a batch-32 decode step.

Usage: python bench/structured_output.py [--prompts 20] [--max-tokens 128] [--batch 32]
           [--decode-tokens 48] [--rounds 3] [--skip-validity] [--skip-speed]

Validity: --prompts chat requests (a short system line asking for JSON, a varied question),
greedy, response_format json_object, then the same with a json_schema of required keys; prints
how many replies parse as a JSON object (and hold the required keys). Speed: one engine (bf16,
as `kvreplay bench throughput`) runs --batch chat requests of the same questions in each mode,
--rounds rounds alternating: free greedy (the LM head's argmax), free greedy through the full
LM head and the sampler (the path a batch with a constrained row takes), and every row constrained to
{"story": string of at least 2,000 characters} (it cannot end within --decode-tokens, so all
rows decode side by side). A decode step is timed only while every row is decoding; the median
step gives tok/s, and the masks' own share (Grammars.mask: the mask fill and its application)
is timed inside the constrained steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SYSTEM = ('Reply only with a compact JSON object, such as {"title": "Dune", "year": 1965}. Keep every '
          'value under five words.')
TOPICS = ["a fictional person", "the weather in Paris", "two fruits and their colors", "a book you like",
          "a cat", "a car for sale", "a city trip plan", "a cooking recipe", "a football match result",
          "a laptop's specifications", "a movie", "a planet", "a song", "a user account", "a pizza order",
          "a flight booking", "a company", "a tree", "a bank transfer", "a museum visit"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "category", "summary"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "category": {"type": "string", "maxLength": 40},
                         "summary": {"type": "string", "maxLength": 120}}}
LONG = {"type": "object", "required": ["story"],
        "properties": {"story": {"type": "string", "minLength": 2000}}}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _conversations(count: int) -> list[list[dict]]:
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} in JSON."}] for i in range(count)]


def validity(llm, count: int, max_tokens: int) -> None:
    from kvreplay import SamplingParams
    conversations = _conversations(count)
    for label, response_format, required in (("json_object", {"type": "json_object"}, []),
                                             ("json_schema", _schema_format(SCHEMA), SCHEMA["required"])):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, response_format=response_format)
        start = time.perf_counter()
        outputs = llm.chat(conversations, params)
        valid = 0
        for output in outputs:
            try:
                value = json.loads(output.outputs[0].text)
            except ValueError:
                continue
            valid += isinstance(value, dict) and all(key in value for key in required)
        print(f"{label}: {valid}/{count} valid JSON objects{' with the required keys' if required else ''} "
              f"(greedy, max_tokens {max_tokens}, {time.perf_counter() - start:.1f} s)")


def _decode_steps(llm, conversations, params, logits_path: bool = False) -> tuple[list[float], float]:
    """Decode-only step times (every sequence decoding, all of them running) and the seconds
    spent in Grammars.mask during those steps. `logits_path`: free rows through the full LM
    head and the sampler, as a batch holding a constrained row runs."""
    engine = llm.engine
    if logits_path:
        engine._argmax_only = lambda batch: False
    masked = [0.0]
    mask = engine.grammars.mask

    def timed_mask(*args):
        start = time.perf_counter()
        mask(*args)
        masked[0] += time.perf_counter() - start
    engine.grammars.mask = timed_mask
    try:
        for conversation in conversations:
            engine.add_request(llm.chat_prompt_ids(conversation), params)
        times, mask_seconds = [], 0.0
        while engine.has_unfinished_requests():
            decoding = not engine.num_waiting and engine.num_running == len(conversations) and all(
                seq.num_uncomputed_tokens <= 1 for seq in engine.scheduler.running)
            before = masked[0]
            start = time.perf_counter()
            engine.step()
            if decoding:
                times.append(time.perf_counter() - start)
                mask_seconds += masked[0] - before
        return times, mask_seconds
    finally:
        del engine.grammars.mask
        engine.__dict__.pop("_argmax_only", None)


def speed(llm, batch: int, decode_tokens: int, rounds: int) -> None:
    from kvreplay import SamplingParams
    conversations = _conversations(batch)
    free = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True)
    modes = {"free (argmax head)": free, "free (logits path)": free,
             "json_schema, every row": SamplingParams(max_tokens=decode_tokens, temperature=0,
                                                      response_format=_schema_format(LONG))}
    _decode_steps(llm, conversations[:2], modes["json_schema, every row"])  # warm-up: llguidance's tokenizer
    steps = {mode: [] for mode in modes}
    mask_ms = []
    for _ in range(rounds):
        for mode, params in modes.items():
            times, mask_seconds = _decode_steps(llm, conversations, params, "logits" in mode)
            steps[mode].append(statistics.median(times) * 1e3)
            if params.response_format:
                mask_ms.append(mask_seconds / len(times) * 1e3)
    free = statistics.median(steps["free (argmax head)"])
    print(f"batch {batch}, {decode_tokens} decode tokens, median of {rounds} rounds")
    print("| mode | decode step ms | tok/s | vs free |")
    print("|---|---|---|---|")
    for mode in modes:
        median = statistics.median(steps[mode])
        print(f"| {mode} | {median:.2f} | {batch / median * 1e3:.0f} | {median / free:.3f}x |")
    print(f"masks (fill + apply) per constrained step: {statistics.median(mask_ms):.2f} ms "
          f"({statistics.median(mask_ms) / free * 100:.1f}% of a free step)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-validity", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args(argv)
    from kvreplay import LLM
    llm = LLM(dtype="bfloat16", kv_cache_memory="512MiB", max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    if not args.skip_validity:
        validity(llm, args.prompts, args.max_tokens)
    if not args.skip_speed:
        speed(llm, args.batch, args.decode_tokens, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

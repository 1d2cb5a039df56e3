"""Prefill and decode throughput of kvreplay against transformers `generate`, side by side.

Usage:
    python bench/engine_throughput.py [--batches 1,8,32] [--prompt-tokens 128] [--decode-tokens 64]
                                      [--dtype bfloat16] [--repeats 3] [--no-peer] [--json out.json]

Each figure is the median of --repeats runs; kvreplay and transformers alternate within each
repeat so that machine noise hits both alike. Decode tokens/s = batch x decode tokens / time after
every sequence has its first token; prefill tokens/s = batch x prompt tokens / time to first tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def _prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
    from pydoc_data.topics import topics
    ids = tokenizer("\n".join(topics[k] for k in sorted(topics))).input_ids
    return [ids[i * 211:i * 211 + length] for i in range(batch)]


def run_kvreplay(llm, prompts, decode_tokens: int) -> tuple[float, float]:
    from kvreplay import SamplingParams
    engine = llm.engine
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first_token_at = None
    while engine.has_unfinished_requests():
        engine.step()
        if first_token_at is None and all(
                s.num_output_tokens >= 1 for r in engine.requests.values() for s in r.seqs) \
                and len(engine.requests) == len(ids):
            first_token_at = time.perf_counter()
    end = time.perf_counter()
    prefill = len(prompts) * len(prompts[0]) / (first_token_at - start)
    decode = len(prompts) * decode_tokens / (end - first_token_at)
    return prefill, decode


def run_transformers(model, prompts, decode_tokens: int) -> tuple[float, float]:
    batch = torch.tensor(prompts)  # equal lengths: no padding needed
    mask = torch.ones_like(batch)

    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(batch, attention_mask=mask, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=2)
        return time.perf_counter() - start

    first = timed(1)
    full = timed(decode_tokens + 1)
    return batch.numel() / first, len(prompts) * decode_tokens / max(full - first, 1e-9)


def run_llama_cpp(model, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    """Single stream through llama.cpp (llama-cpp-python) on the same GGUF file."""
    model.reset()
    start = time.perf_counter()
    first_token_at, count = None, 0
    for _ in model.create_completion(prompt, max_tokens=decode_tokens + 1, temperature=0.0, stream=True,
                                     logit_bias={model.token_eos(): -1e9}):
        count += 1
        if first_token_at is None:
            first_token_at = time.perf_counter()
    end = time.perf_counter()
    return len(prompt) / (first_token_at - start), (count - 1) / (end - first_token_at)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also time llama.cpp single-stream (needs llama-cpp-python)")
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from kvreplay import LLM
    from kvreplay.models.loader import default_model_path
    # No prefix caching: repeats send the same prompts, and transformers has nothing alike.
    llm = LLM(dtype=args.dtype, kv_cache_memory="512MiB", max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    peer = None
    if not args.no_peer:
        from transformers import AutoModelForCausalLM
        path = default_model_path()
        peer = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=getattr(torch, args.dtype)).eval()
    llama = None
    if args.llama_cpp:
        from llama_cpp import Llama
        llama = Llama(model_path=default_model_path(), n_ctx=args.prompt_tokens + args.decode_tokens + 16,
                      n_threads=args.threads, n_batch=512, verbose=False)
    rows = []
    llama_runs: list[tuple[float, float]] = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = _prompts(llm.tokenizer, batch, args.prompt_tokens)
        ours, theirs = [], []
        run_kvreplay(llm, prompts[:1], 4)  # warm-up
        for _ in range(args.repeats):
            ours.append(run_kvreplay(llm, prompts, args.decode_tokens))
            if peer is not None:
                theirs.append(run_transformers(peer, prompts, args.decode_tokens))
            if llama is not None and batch == 1:
                llama_runs.append(run_llama_cpp(llama, prompts[0], args.decode_tokens))
        row = {"batch": batch,
               "kvreplay_prefill_tok_s": statistics.median(p for p, _ in ours),
               "kvreplay_decode_tok_s": statistics.median(d for _, d in ours)}
        if theirs:
            row["transformers_prefill_tok_s"] = statistics.median(p for p, _ in theirs)
            row["transformers_decode_tok_s"] = statistics.median(d for _, d in theirs)
            row["decode_ratio"] = row["kvreplay_decode_tok_s"] / row["transformers_decode_tok_s"]
            row["prefill_ratio"] = row["kvreplay_prefill_tok_s"] / row["transformers_prefill_tok_s"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    print(f"\n{args.dtype}, prompt {args.prompt_tokens} tokens, {args.decode_tokens} decode tokens, "
          f"median of {args.repeats}, torch threads {torch.get_num_threads()}\n")
    header = "| batch | kvreplay prefill tok/s | kvreplay decode tok/s |"
    if peer is not None:
        header += " transformers prefill tok/s | transformers decode tok/s | prefill ratio | decode ratio |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        line = f"| {r['batch']} | {r['kvreplay_prefill_tok_s']:.0f} | {r['kvreplay_decode_tok_s']:.1f} |"
        if peer is not None:
            line += (f" {r['transformers_prefill_tok_s']:.0f} | {r['transformers_decode_tok_s']:.1f} |"
                     f" {r['prefill_ratio']:.2f}x | {r['decode_ratio']:.2f}x |")
        print(line)
    llama_row = None
    if llama_runs:
        llama_row = {"llama_cpp_prefill_tok_s": statistics.median(p for p, _ in llama_runs),
                     "llama_cpp_decode_tok_s": statistics.median(d for _, d in llama_runs)}
        print(f"\nllama.cpp single stream (same GGUF, Q4_1 weights, {args.threads} threads): prefill "
              f"{llama_row['llama_cpp_prefill_tok_s']:.0f} tok/s, decode {llama_row['llama_cpp_decode_tok_s']:.1f} tok/s\n")
        print("| batch | kvreplay decode / llama.cpp single-stream decode |")
        print("|---|---|")
        for r in rows:
            r["decode_vs_llama_cpp"] = r["kvreplay_decode_tok_s"] / llama_row["llama_cpp_decode_tok_s"]
            print(f"| {r['batch']} | {r['decode_vs_llama_cpp']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "llama_cpp": llama_row}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

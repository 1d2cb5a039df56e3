"""Prefill and decode throughput of kvreplay against transformers `generate`, side by side.

Usage:
    kvreplay bench throughput [--batches 1,8,32] [--prompt-tokens 128] [--decode-tokens 64]
                              [--dtype bfloat16] [--repeats 3] [--threads 2] [--no-peer]
                              [--llama-cpp] [--device cuda] [--model PATH] [--json out.json]
    (python bench/engine_throughput.py takes the same arguments)

Every measurement runs in a fresh interpreter (`python -m kvreplay.bench.throughput --worker
kvreplay|transformers|llama_cpp --batch N ...`, which prints one JSON line), so each engine has a
process to itself. Why: an earlier version loaded both models into one process, and there
kvreplay's batch-32 decode fell from ~458 tok/s (alone in its process) to ~270 tok/s once the
transformers model was loaded and had run `generate`. The cause was not pinned down (the shared allocator, OpenMP/oneDNN thread pools and
primitive caches, the CPU caches are the candidates), but a figure taken that way measures the
interference as much as the engines. A fresh process per engine and run is fair to both: nothing
of one engine is left in the other's process.

Fairness: both workers get the same prompts (token ids of the same text, equal lengths, no padding),
the same thread count (--threads, set as OMP_NUM_THREADS/MKL_NUM_THREADS in the worker's
environment and with torch.set_num_threads), the same dtype, and one untimed warm-up at the measured
batch shape before the timed run. Within each repeat the engines run one after the other, and the
order rotates from repeat to repeat (kvreplay first, then transformers first, ...) so that machine
noise and drift hit both alike. Each figure is the median over --repeats fresh processes.
OMP_WAIT_POLICY=PASSIVE in the environment (inherited by the workers) keeps idle OpenMP threads
from spinning against other processes, but every parallel region then wakes sleeping threads:
on the Xeon of docs/benchmarks.md it cut kvreplay's decode 2-3x and llama.cpp's ~4x (26 against
110 tok/s). The figures in docs/benchmarks.md run without it.

Decode tokens/s = tokens generated after every sequence has its first token / the time that
takes (batch x decode tokens, less those that sequences prefilled in an earlier chunk already
produced by then); prefill tokens/s = batch x prompt tokens / time until every sequence has its
first token. Both come from one timed call per engine: kvreplay steps its engine; transformers
runs one `generate(max_new_tokens=decode+1)` whose stopping criterion stamps the time of each
token (an earlier version took the difference of two `generate` calls, 1 and decode+1 new tokens;
with few decode tokens the jitter of the two prefills swamped the decode time). llama.cpp
(--llama-cpp) is a single stream on the same GGUF file, measured once per repeat at batch 1 (or at
the first listed batch when 1 is not listed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ENGINES = ("kvreplay", "transformers", "llama_cpp")


# ---------------------------------------------------------------- worker side (one engine, one run)

def _prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
    from pydoc_data.topics import topics
    ids = tokenizer("\n".join(topics[k] for k in sorted(topics))).input_ids
    if len(ids) < (batch - 1) * 211 + length:
        raise ValueError(f"not enough text for {batch} prompts of {length} tokens")
    return [ids[i * 211:i * 211 + length] for i in range(batch)]


def run_kvreplay(llm, prompts, decode_tokens: int) -> tuple[float, float]:
    """Prefill ends when every sequence has its first token. With chunked prefill some sequences
    are already decoding by then (or even done), so decode counts the tokens produced after it."""
    from kvreplay import SamplingParams
    engine = llm.engine
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0, ignore_eos=True)
    total = len(prompts) * (decode_tokens + 1)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    first_token_at, done_at_first = None, 0
    while engine.has_unfinished_requests():
        engine.step()
        if first_token_at is None:
            live = [s for r in engine.requests.values() for s in r.seqs]  # finished requests are gone
            if all(s.num_output_tokens >= 1 for s in live):
                first_token_at = time.perf_counter()
                done_at_first = total - sum(decode_tokens + 1 - s.num_output_tokens for s in live)
    end = time.perf_counter()
    prefill = len(prompts) * len(prompts[0]) / (first_token_at - start)
    decode = (total - done_at_first) / max(end - first_token_at, 1e-9)
    return prefill, decode


def run_transformers(model, prompts, decode_tokens: int) -> tuple[float, float]:
    """One `generate` call, clocked like kvreplay: a stopping criterion (called once per generated
    token, never stopping) stamps the time each token is out, so the first stamp ends prefill
    (on CUDA after waiting for the GPU, as kvreplay's step does when it reads its tokens)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        def __init__(self):
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.is_cuda:
                torch.cuda.synchronize(input_ids.device)
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    batch = torch.tensor(prompts, device=model.device)  # equal lengths: no padding needed
    clock = Clock()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=decode_tokens + 1,
                       min_new_tokens=decode_tokens + 1, do_sample=False, pad_token_id=2,
                       stopping_criteria=StoppingCriteriaList([clock]))
    end = time.perf_counter()
    if len(clock.stamps) != decode_tokens + 1:
        raise RuntimeError(f"transformers generated {len(clock.stamps)} tokens, not {decode_tokens + 1}")
    first_token_at = clock.stamps[0]
    return batch.numel() / (first_token_at - start), len(prompts) * decode_tokens / max(end - first_token_at, 1e-9)


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
    return len(prompt) / (first_token_at - start), (count - 1) / max(end - first_token_at, 1e-9)


def worker(args) -> dict:
    """Load one engine, warm it up at the measured shape, time one run; return the figures."""
    import torch
    torch.set_num_threads(args.threads)
    from kvreplay.models.loader import load_tokenizer, resolve_model_path
    path = resolve_model_path(args.model)
    prompts = _prompts(load_tokenizer(args.model), args.batch, args.prompt_tokens)
    load_start = time.perf_counter()
    extra = {}
    if args.worker == "kvreplay":
        from kvreplay import LLM
        # No prefix caching: the warm-up sends the same prompts, and transformers has nothing alike.
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device, kv_cache_memory="512MiB",
                  max_num_batched_tokens=2048, enable_prefix_caching=False,
                  attention_backend=args.attention_backend)
        load_s = time.perf_counter() - load_start
        extra = {"attention": "triton" if llm.engine.config.use_triton else "torch"}
        run_kvreplay(llm, prompts, 2)  # warm-up: same batch, prompts and shapes
        prefill, decode = run_kvreplay(llm, prompts, args.decode_tokens)
    elif args.worker == "transformers":
        from transformers import AutoModelForCausalLM
        where = dict(pretrained_model_name_or_path=path) if os.path.isdir(path) else \
            dict(pretrained_model_name_or_path=os.path.dirname(path), gguf_file=os.path.basename(path))
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=getattr(torch, args.dtype)) \
            .to(args.device).eval()
        load_s = time.perf_counter() - load_start
        # What the peer really computes with (a GGUF load may keep packed weights on some setups).
        linear = model.model.layers[0].self_attn.q_proj
        extra = {"peer_linear": type(linear).__name__, "peer_weight_dtype": str(linear.weight.dtype),
                 "peer_attn": model.config._attn_implementation}
        with torch.no_grad():  # warm-up: same batch and prompt length
            batch = torch.tensor(prompts, device=model.device)
            model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=3,
                           min_new_tokens=3, do_sample=False, pad_token_id=2)
        prefill, decode = run_transformers(model, prompts, args.decode_tokens)
    elif args.worker == "llama_cpp":
        from llama_cpp import Llama
        model = Llama(model_path=path, n_ctx=args.prompt_tokens + args.decode_tokens + 16,
                      n_threads=args.threads, n_batch=512, verbose=False)
        load_s = time.perf_counter() - load_start
        run_llama_cpp(model, prompts[0], 2)  # warm-up
        prefill, decode = run_llama_cpp(model, prompts[0], args.decode_tokens)
    else:
        raise ValueError(f"unknown worker {args.worker!r}")
    return {"engine": args.worker, "batch": args.batch if args.worker != "llama_cpp" else 1,
            "prefill_tok_s": prefill, "decode_tok_s": decode, "load_s": load_s,
            "threads": torch.get_num_threads(), "pid": os.getpid(), **extra}


# ---------------------------------------------------------------- parent side (drives the workers)

def spawn(engine: str, batch: int, args) -> dict:
    """Run one measurement in a fresh interpreter; its last stdout line is the JSON result."""
    cmd = [sys.executable, "-m", "kvreplay.bench.throughput", "--worker", engine, "--batch", str(batch),
           "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens),
           "--dtype", args.dtype, "--threads", str(args.threads), "--device", args.device,
           "--attention-backend", args.attention_backend]
    if args.model is not None:
        cmd += ["--model", args.model]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise RuntimeError(f"worker {engine} (batch {batch}) failed with exit code {proc.returncode}")
    return json.loads(lines[-1])


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _batches(text: str) -> list[int]:
    try:
        return [_positive(v.strip()) for v in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected batch sizes like 1,8,32, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `kvreplay bench throughput` (and of bench/engine_throughput.py)."""
    from kvreplay.config import default_device
    from kvreplay.kernels.triton_backend import BACKENDS
    parser.add_argument("--batches", type=_batches, default=[1, 8, 32],
                        help="comma-separated batch sizes (default: 1,8,32)")
    parser.add_argument("--prompt-tokens", type=_positive, default=128, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--decode-tokens", type=_positive, default=64,
                        help="tokens generated per sequence after its first (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="weights and activations of kvreplay and transformers (default: %(default)s)")
    parser.add_argument("--repeats", type=_positive, default=3,
                        help="fresh processes per engine and batch; figures are their medians (default: %(default)s)")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also time llama.cpp single-stream on the same GGUF file (needs llama-cpp-python)")
    parser.add_argument("--model", default=None,
                        help="a .gguf file or Hugging Face model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--threads", type=_positive, default=2,
                        help="torch / OpenMP threads, the same for every engine (default: %(default)s)")
    parser.add_argument("--device", default=default_device(),
                        help="cpu or cuda[:N] for kvreplay and transformers; llama.cpp stays on the CPU "
                             "(default: $KVREPLAY_DEVICE, else %(default)s)")
    parser.add_argument("--attention-backend", default="auto", choices=BACKENDS,
                        help="kvreplay's attention kernels (EngineConfig.attention_backend; default: %(default)s)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--worker", choices=ENGINES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    try:
        return run(args)
    except ValueError as exc:
        parser.error(str(exc))


def run(args) -> int:
    """Drive the workers for every batch size and engine; print the table (and write --json)."""
    from kvreplay.config import check_device
    from kvreplay.models.loader import resolve_model_path
    check_device(args.device)  # clear errors before any worker starts
    path = resolve_model_path(args.model)
    if args.llama_cpp and not path.endswith(".gguf"):
        raise ValueError(f"--llama-cpp needs a .gguf model file, not {path}")
    batches = args.batches
    llama_batch = 1 if 1 in batches else batches[0]
    rows, runs = [], []
    llama_runs: list[dict] = []
    for batch in batches:
        engines = ["kvreplay"] + ([] if args.no_peer else ["transformers"]) \
            + (["llama_cpp"] if args.llama_cpp and batch == llama_batch else [])
        results: dict[str, list[dict]] = {e: [] for e in engines}
        for repeat in range(args.repeats):
            order = engines[repeat % len(engines):] + engines[:repeat % len(engines)]
            for engine in order:
                result = spawn(engine, batch, args)
                result["repeat"] = repeat
                results[engine].append(result)
                runs.append(result)
                print(json.dumps(result), file=sys.stderr, flush=True)
        ours, theirs = results["kvreplay"], results.get("transformers", [])
        llama_runs += results.get("llama_cpp", [])
        row = {"batch": batch,
               "kvreplay_prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in ours),
               "kvreplay_decode_tok_s": statistics.median(r["decode_tok_s"] for r in ours)}
        if theirs:
            row["transformers_prefill_tok_s"] = statistics.median(r["prefill_tok_s"] for r in theirs)
            row["transformers_decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in theirs)
            row["decode_ratio"] = row["kvreplay_decode_tok_s"] / row["transformers_decode_tok_s"]
            row["prefill_ratio"] = row["kvreplay_prefill_tok_s"] / row["transformers_prefill_tok_s"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    threads = sorted({r["threads"] for r in runs if r["engine"] != "llama_cpp"})
    print(f"\n{args.dtype}, prompt {args.prompt_tokens} tokens, {args.decode_tokens} decode tokens, "
          f"median of {args.repeats}, torch threads {','.join(map(str, threads))}, "
          f"one fresh process per engine and repeat\n")
    header = "| batch | kvreplay prefill tok/s | kvreplay decode tok/s |"
    if not args.no_peer:
        header += " transformers prefill tok/s | transformers decode tok/s | prefill ratio | decode ratio |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        line = f"| {r['batch']} | {r['kvreplay_prefill_tok_s']:.0f} | {r['kvreplay_decode_tok_s']:.1f} |"
        if not args.no_peer:
            line += (f" {r['transformers_prefill_tok_s']:.0f} | {r['transformers_decode_tok_s']:.1f} |"
                     f" {r['prefill_ratio']:.2f}x | {r['decode_ratio']:.2f}x |")
        print(line)
    llama_row = None
    if llama_runs:
        llama_row = {"llama_cpp_prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in llama_runs),
                     "llama_cpp_decode_tok_s": statistics.median(r["decode_tok_s"] for r in llama_runs)}
        print(f"\nllama.cpp single stream (same GGUF file, {args.threads} threads): prefill "
              f"{llama_row['llama_cpp_prefill_tok_s']:.0f} tok/s, decode {llama_row['llama_cpp_decode_tok_s']:.1f} tok/s\n")
        print("| batch | kvreplay decode / llama.cpp single-stream decode |")
        print("|---|---|")
        for r in rows:
            r["decode_vs_llama_cpp"] = r["kvreplay_decode_tok_s"] / llama_row["llama_cpp_decode_tok_s"]
            print(f"| {r['batch']} | {r['decode_vs_llama_cpp']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()
                                if isinstance(v, (str, int, float, bool, list, type(None)))},
                       "rows": rows, "llama_cpp": llama_row, "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

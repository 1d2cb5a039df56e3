"""Prefill and decode throughput of kvreplay against transformers `generate` (and llama.cpp),
side by side: `kvreplay bench throughput` (kvreplay/bench/throughput.py), kept here under its old
name for the commands in docs/benchmarks.md. Same arguments; `--help` lists them."""
import sys

from kvreplay.bench.throughput import main

if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks of docs/architecture.md §8: the serving workload and its metrics, quality against full attention,
peers, reports and plots. The CLI front end is `kvreplay bench` (kvreplay/commands/bench.py)."""

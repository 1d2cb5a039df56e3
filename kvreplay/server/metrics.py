"""Prometheus metrics (docs/architecture.md §7), prefix `kvreplay_`, plus vLLM's names for the
series that routers scrape (llm-d's scheduler, Dynamo's router; docs/multi-node.md).

Engine-side values come from the snapshot the engine thread publishes after each step, read at
scrape time by a custom collector, so the HTTP thread never reads live engine state. Per-request
KV counters (pauses, replays, ...) are totals of the finished sequences' RequestStats; they stay
0 until a policy acts. Latency histograms are observed by the HTTP handlers.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvreplay.server.generation import EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# metric name (without kvreplay_ and _total) -> (EngineCounters field, help)
_ENGINE_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens admitted to the engine"),
    "generation_tokens": ("generation_tokens", "Tokens generated"),
    "engine_steps": ("steps", "Engine steps run"),
    "preemptions": ("preemptions", "Sequences preempted for lack of KV blocks"),
    "requests_finished": ("requests_finished", "Engine requests that finished"),
    "requests_aborted": ("requests_aborted", "Engine requests aborted (client gone, shutdown)"),
    "need_checks": ("need_checks", "Decode rows the replay need detector examined"),
    "need_fires": ("need_fires", "Decode steps redone after the need detector asked for a replay"),
    "sparse_selected_blocks": ("sparse_selected_blocks",
                               "Cold blocks decode attention read (per layer and KV head)"),
    "sparse_candidate_blocks": ("sparse_candidate_blocks",
                                "Cold blocks decode attention could have read (per layer and KV head)"),
    "hot_blocks_read": ("hot_blocks_read", "Hot blocks decode attention read (per layer and KV head)"),
    "dequant_seconds": ("dequant_seconds", "Seconds spent dequantizing cold blocks for attention"),
    "decode_seconds": ("decode_seconds", "Seconds of engine steps that decoded"),
}
# metric name -> (RequestStats field, help)
_REQUEST_STAT_COUNTERS = {
    "prefix_cache_hit_tokens": ("prefix_hit_tokens", "Prompt tokens served from the prefix cache"),
    "pauses": ("pauses", "Times a sequence was paused"),
    "replays": ("replays", "KV replays (recomputation of dropped blocks)"),
    "replayed_tokens": ("replayed_tokens", "Tokens recomputed by replays"),
    "dropped_tokens": ("dropped_tokens", "Tokens whose KV was dropped"),
    "cold_blocks": ("cold_blocks", "Blocks demoted to the cold tier"),
    "approx_tokens": ("approx_tokens", "Tokens attended approximately (sparse or quantized KV)"),
    "replay_mismatches": ("replay_mismatches", "Replays whose recomputed KV did not match"),
    "kv_tier_loaded_tokens": ("tier_loaded_tokens", "Tokens loaded from the session tier instead of recomputed"),
    "kv_tier_overlapped_tokens": ("tier_overlapped_tokens",
                                  "Tokens loaded from the session tier in the background while a head was recomputed"),
    "kv_tier_recomputed_tokens": ("tier_recomputed_tokens",
                                  "Tokens the session tier held but recompute was predicted cheaper"),
}
# metric name -> (SessionTier.snapshot() key, help): the session tier's counters
_TIER_COUNTERS = {
    "kv_tier_loads": ("loads", "Blocks loaded from the session tier"),
    "kv_tier_load_bytes": ("load_bytes", "Bytes loaded from the session tier"),
    "kv_tier_hits": ("hits", "Session tier lookups that found the block"),
    "kv_tier_misses": ("misses", "Session tier lookups that did not (or found a bad file)"),
    "kv_tier_corrupted_files": ("corrupted", "Session tier files discarded: torn or failed their checksum"),
    "kv_tier_discarded_blocks": ("discarded", "Blocks that fell off the session tier's last level"),
}

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str):
        self._snapshot = snapshot
        self._labels = [model_name, "0"]  # vLLM's labels: model_name, engine

    def collect(self):
        snap = self._snapshot()
        yield from self._vllm_names(snap)
        usage = GaugeMetricFamily("kvreplay_kv_usage_ratio", "Fraction of KV blocks in use, per tier",
                                  labels=["tier"])
        total = snap.num_blocks or 1
        usage.add_metric(["hot"], (snap.num_used_blocks - snap.num_index_blocks) / total)
        usage.add_metric(["index"], snap.index_bytes / (total * snap.block_bytes))
        usage.add_metric(["cold"], snap.cold_bytes / (total * snap.block_bytes))
        yield usage
        counters = snap.counters
        selected, candidates = counters.get("sparse_selected_blocks", 0), counters.get("sparse_candidate_blocks", 0)
        hot_reads, decode_seconds = counters.get("hot_blocks_read", 0), counters.get("decode_seconds", 0.0)
        yield GaugeMetricFamily("kvreplay_sparse_hit_rate",
                                "Cold blocks read / cold blocks that could have been (0 before any)",
                                value=selected / candidates if candidates else 0.0)
        yield GaugeMetricFamily("kvreplay_hot_cold_access_ratio",
                                "Hot block reads per cold block read in decode attention (0 before any cold read)",
                                value=hot_reads / selected if selected else 0.0)
        yield GaugeMetricFamily("kvreplay_dequant_time_share",
                                "Share of decode-step time spent dequantizing cold blocks",
                                value=counters.get("dequant_seconds", 0.0) / decode_seconds if decode_seconds else 0.0)
        blocks = GaugeMetricFamily("kvreplay_kv_blocks", "KV blocks per tier and state",
                                   labels=["tier", "state"])
        blocks.add_metric(["hot", "used"], snap.num_used_blocks - snap.num_index_blocks)
        blocks.add_metric(["reserved", "used"], snap.num_index_blocks)
        blocks.add_metric(["hot", "free"], snap.num_blocks - snap.num_used_blocks)
        yield blocks
        groups = GaugeMetricFamily("kvreplay_kv_blocks_by_group",
                                   "KV blocks per layer group (global: layers that keep every block; local: "
                                   "a hybrid pool's sliding-window layers) and state (used, cached free)",
                                   labels=["group", "state"])
        for group, counts in snap.blocks_by_group.items():
            for state, count in counts.items():
                groups.add_metric([group, state], count)
        yield groups
        yield GaugeMetricFamily("kvreplay_num_requests_running", "Sequences in the running batch",
                                value=snap.num_running)
        yield GaugeMetricFamily("kvreplay_num_requests_waiting", "Sequences waiting to be scheduled",
                                value=snap.num_waiting)
        for name, (source, doc) in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"kvreplay_{name}", doc, value=snap.counters.get(source, 0))
        for name, (source, doc) in _REQUEST_STAT_COUNTERS.items():
            yield CounterMetricFamily(f"kvreplay_{name}", doc, value=snap.request_stats.get(source, 0))
        tier = GaugeMetricFamily("kvreplay_kv_tier_bytes", "Bytes in the session tier", labels=["tier"])
        for level in ("memory", "disk"):
            tier.add_metric([level], snap.tier.get(f"{level}_bytes", 0))
        yield tier
        for name, (source, doc) in _TIER_COUNTERS.items():
            yield CounterMetricFamily(f"kvreplay_{name}", doc, value=snap.tier.get(source, 0))

    def _vllm_names(self, snap: EngineSnapshot):
        """The gauges and counters routers read, under vLLM's names and labels, from the same
        snapshot as the kvreplay_ series they mirror: requests running and waiting, the used
        share of the pool (`kvreplay_kv_blocks` used / all), and prompt tokens looked up in the
        prefix cache against those found there (`kvreplay_prompt_tokens_total`,
        `kvreplay_prefix_cache_hit_tokens_total`; hits are counted when a request ends)."""
        labels = ["model_name", "engine"]
        for name, doc, value in [
                ("vllm:num_requests_running", "Sequences in the running batch", snap.num_running),
                ("vllm:num_requests_waiting", "Sequences waiting to be scheduled", snap.num_waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full",
                 snap.num_used_blocks / snap.num_blocks if snap.num_blocks else 0.0)]:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(self._labels, value)
            yield gauge
        for name, doc, value in [
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 snap.counters.get("prompt_tokens", 0)),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                 snap.request_stats.get("prefix_hit_tokens", 0))]:
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(self._labels, value)
            yield counter


class ServerMetrics:
    """One registry per server (not the global one), so tests can run several apps."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str = "kvreplay-default"):
        disable_created_metrics()  # the *_created series only clutter a scrape
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(snapshot, model_name))
        self.http_requests = Counter(
            "kvreplay_requests", "Generation requests answered, by endpoint and HTTP status",
            ["endpoint", "status"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "kvreplay_time_to_first_token_seconds", "Arrival to first streamed token",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.time_per_output_token = Histogram(
            "kvreplay_time_per_output_token_seconds", "Mean gap between streamed tokens after the first",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.request_latency = Histogram(
            "kvreplay_e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS,
            registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

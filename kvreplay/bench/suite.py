"""Side-by-side runs: one workload, each policy (and peer) in turn, one result document."""
from __future__ import annotations

import gc
import threading
from dataclasses import asdict, replace

from kvreplay.bench.report import environment
from kvreplay.bench.workload import WorkloadSpec, corpus_token_ids, make_workload
from kvreplay.config import EngineConfig
from kvreplay.models.loader import load_tokenizer


def check_policies(config: EngineConfig, policies: list[str]) -> list[EngineConfig]:
    """One config per policy; an unknown policy fails here, before any model loads."""
    if not policies:
        raise ValueError("give at least one policy")
    return [replace(config, policy=p) for p in policies]


def make_llm(config: EngineConfig):
    from kvreplay.api import LLM
    fields = {k: getattr(config, k) for k in config.__dataclass_fields__}
    return LLM(**fields)


def serve_suite(config: EngineConfig, spec: WorkloadSpec, policies: list[str], url: str | None = None,
                peers: list[str] = (), progress: bool = True, on_step=None,
                budgets: list[str] | None = None, kv_maps: dict | None = None) -> dict:
    """Run `spec` under each policy (x each KV budget) in-process, or once against `url`; then
    each peer. Runs are labelled `policy` (or `policy@budget` with several budgets). With
    `kv_maps` (a dict), each run's recorded KV map states are put there under its label."""
    from kvreplay.bench import serve
    from kvreplay.bench.kv_map import KVMapRecorder, poll_server
    budgets = budgets or [config.kv_cache_memory]
    configs = [replace(c, kv_cache_memory=b) for c in check_policies(config, policies) for b in budgets]
    result = {"kind": "serve", "environment": environment(), "workload": asdict(spec),
              "engine": {k: v for k, v in asdict(config).items() if k not in ("policy", "kv_cache_memory")},
              "runs": [], "peers": []}
    if url:
        tokenizer = load_tokenizer(config.model)
        warmup, timed = make_workload(spec, corpus_token_ids(tokenizer))
        stop, states = threading.Event(), []
        poller = threading.Thread(target=poll_server, args=(url, states, stop), daemon=True)
        if kv_maps is not None:
            poller.start()
        try:
            run = serve.run_against_url(url, timed, warmup, progress=progress)
        finally:
            stop.set()
        if kv_maps is not None:
            poller.join()
            kv_maps[run.label] = states
        result["runs"].append(run.as_dict())
    else:
        timed = None
        for policy_config in configs:
            llm = make_llm(policy_config)
            if timed is None:
                warmup, timed = make_workload(spec, corpus_token_ids(llm.tokenizer), llm.engine.max_model_len)
            label = policy_config.policy + (f"@{policy_config.kv_cache_memory}" if len(budgets) > 1 else "")
            recorder = KVMapRecorder() if kv_maps is not None else None
            run = serve.run_in_process(llm.engine, timed, warmup, label=label, progress=progress,
                                       on_step=on_step, kv_map=recorder)
            if recorder is not None:
                kv_maps[label] = recorder.states
            result["runs"].append(run.as_dict() | {"policy": policy_config.policy,
                                                   "budget": policy_config.kv_cache_memory})
            del llm
            gc.collect()
    if peers:
        from kvreplay.bench import peers as peer_module
        # against the first policy at its largest budget: the peers have no KV budget
        first = [r for r in result["runs"] if r.get("policy", r["label"]) == policies[0]] or result["runs"]
        ours = max(first, key=lambda r: r["kv"].get("capacity_bytes", 0))["metrics"]["output_token_throughput"]
        for name in peers:
            result["peers"].append(peer_module.run_serve_peer(name, config, timed, warmup, ours, progress))
    return result

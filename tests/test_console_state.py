"""The KV map (engine/kv_map.py) against the KV manager's own view: after every random step of a
tiny engine (conftest's random Llama, small pools, several policies) each live sequence's zone
runs cover its tokens exactly once, and their dropped, cold, indexed and hot blocks are the
manager's; the pool figures are the manager's; the pool passes check_integrity(). Then the same
picture through `GET /v1/kv/state` of an app on that engine."""
from __future__ import annotations

import json
import random
import threading

import pytest

from kvreplay import LLM, SamplingParams
from kvreplay.engine.kv_map import ZONES, kv_state
from kvreplay.kv.manager import DROPPED

POLICIES = [("replay", {"trim": "prefill"}), ("replay+cold", {"resident_ratio": 0.5, "cold_dtype": "int8"}),
            ("window", {}), ("full", {})]


def _tokens(count: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(count)]


def _blocks_of(runs: list[list], block_size: int, zones: set[str]) -> set[int]:
    """Table indices of the blocks any of whose tokens lie in `zones`."""
    found, position = set(), 0
    for zone, count in runs:
        if zone in zones:
            found.update(range(position // block_size, (position + count - 1) // block_size + 1))
        position += count
    return found


def _check_against_manager(engine, state: dict) -> None:
    kv = engine.kv
    engine.check_integrity()
    pool = state["pool"]
    assert (pool["num_blocks"], pool["num_used_blocks"], pool["num_reserved_blocks"]) == \
        (kv.num_blocks, kv.num_used_blocks, kv.num_reserved_blocks)
    assert (pool["index_bytes"], pool["cold_bytes"]) == (kv.index_bytes, kv.cold_bytes)
    assert pool["groups"] == {"global": {"used": kv.num_used_blocks - kv.num_reserved_blocks,
                                         "cached": kv.num_cached_blocks}}  # a Llama: one layer group
    assert state["usage"]["used"] == pytest.approx(kv.num_used_blocks / kv.num_blocks)
    live = {seq.seq_id: seq for request in engine.requests.values() for seq in request.seqs
            if not seq.is_finished}
    assert {s["seq_id"] for s in state["sequences"]} == set(live)
    assert state["num_running"] == engine.num_running
    for shown in state["sequences"]:
        seq, bs = live[shown["seq_id"]], kv.block_size
        runs = shown["runs"]
        assert all(zone in ZONES and count > 0 for zone, count in runs)
        assert all(a[0] != b[0] for a, b in zip(runs, runs[1:])), "neighbour runs not merged"
        assert sum(count for _, count in runs) == seq.num_tokens == shown["num_tokens"]
        pending = sum(count for zone, count in runs if zone == "pending")
        table = kv.block_table(seq.seq_id)
        assert pending == seq.num_tokens - min(seq.num_computed_tokens, len(table) * bs)
        dropped = set(kv.dropped_blocks(seq.seq_id))
        cold = set(kv.cold_blocks(seq.seq_id))
        indexed = {index for index, _ in kv.indexed_blocks(seq.seq_id)}
        assert _blocks_of(runs, bs, {"cold"}) == cold
        assert _blocks_of(runs, bs, {"dropped", "evicted", "replaying", "cold"}) == dropped
        assert _blocks_of(runs, bs, {"dropped"}) <= indexed
        assert not _blocks_of(runs, bs, {"evicted"}) & indexed
        hot = _blocks_of(runs, bs, {"window", "heavy", "hot"})
        assert hot <= {i for i, block in enumerate(table) if block != DROPPED}
        if _blocks_of(runs, bs, {"replaying"}):
            assert shown["replaying"]


@pytest.mark.parametrize("policy,knobs", POLICIES, ids=[p for p, _ in POLICIES])
def test_state_matches_the_kv_manager_after_random_steps(tiny_model, policy, knobs):
    rng = random.Random(policy)
    llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="192KiB", block_size=8,
              policy=policy, window_tokens=16, sink_tokens=4, max_num_batched_tokens=64,
              **knobs)
    engine, seen = llm.engine, set()
    for step in range(60):
        if rng.random() < 0.3 and engine.num_waiting < 3:
            params = SamplingParams(max_tokens=rng.randrange(4, 24), temperature=0, ignore_eos=True)
            engine.add_request(_tokens(rng.randrange(20, 160), rng), params,
                               protected_tokens=rng.choice([0, 12]))
        if rng.random() < 0.05 and engine.requests:
            engine.abort_request(rng.choice(sorted(engine.requests)))
        engine.step()
        state = json.loads(json.dumps(kv_state(engine, float(step))))  # JSON-clean
        _check_against_manager(engine, state)
        seen.update(zone for s in state["sequences"] for zone, _ in s["runs"])
    while engine.has_unfinished_requests():
        engine.step()
    assert kv_state(engine, 0.0)["sequences"] == []
    assert {"sinks", "protected", "pending"} <= seen
    expected = {"replay": {"dropped", "window"}, "replay+cold": {"cold", "window"},
                "window": {"evicted", "window"}, "full": {"hot"}}
    assert expected[policy] <= seen, seen


def test_state_endpoint_serves_the_engine_threads_picture(tiny_model):
    """/v1/kv/state during a request's decode: the engine thread's picture, JSON."""
    from fastapi.testclient import TestClient
    from kvreplay.server.app import build_app
    from kvreplay.server.async_engine import AsyncEngine
    from kvreplay.server.config import ServerConfig
    llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="256KiB", block_size=8,
              policy="replay", trim="prefill", window_tokens=16)
    engine = AsyncEngine(llm)
    with TestClient(build_app(engine, ServerConfig())) as client:
        assert client.get("/v1/kv/state").json()["sequences"] == []
        prompt = _tokens(120, random.Random(1))
        body = {"prompt": prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
        sender = threading.Thread(target=lambda: client.post("/v1/completions", json=body))
        sender.start()
        states = []  # (TestClient buffers a streamed body: poll while another thread waits)
        while sender.is_alive() and len(states) < 3:
            state = client.get("/v1/kv/state").json()
            if state["sequences"] and state["sequences"][0]["num_computed_tokens"] > 120:
                states.append(state)
        sender.join()
        assert len(states) == 3, "the request ended before three states were seen"
        assert client.get("/v1/kv/state").json()["sequences"] == []
        for state in states:
            assert state["policy"]["name"] == "replay" and state["policy"]["trim"] == "prefill"
            (seq,) = state["sequences"]
            assert sum(count for _, count in seq["runs"]) == seq["num_tokens"] > 120
            assert "dropped" in [zone for zone, _ in seq["runs"]]

"""KV events (engine/kv_events.py): a ZMQ subscriber on loopback rebuilds, from the events alone,
the engine's own map of held block hashes to tiers (kv/held.py), after every step of a random run
on a tiny pool with prefix hits, evictions, drops, replays, kept sessions and aborts."""
from __future__ import annotations

import random
import threading
import time

import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from kvreplay import LLM, SamplingParams  # noqa: E402
from kvreplay.kv.held import held_blocks  # noqa: E402
from kvreplay.server.launch import free_port  # noqa: E402

SHARED = random.Random(7).sample(range(100, 40000), 96)  # a common head: prefix hits


class Subscriber:
    """vLLM's subscriber, reduced: a SUB socket on its own thread, each batch applied to
    hash -> medium as it arrives; sequence numbers must run 0, 1, 2, ... with no gap."""

    def __init__(self, endpoint: str):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.connect(endpoint)
        self.held: dict[int, str] = {}
        self.last_seq = -1
        self.kinds: set[str] = set()
        self.stop = False
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            if not self.socket.poll(50):
                continue
            topic, seq_bytes, payload = self.socket.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq != self.last_seq + 1:
                self.error = f"batch {seq} after {self.last_seq}"
            self.last_seq = seq
            timestamp, events = msgpack.unpackb(payload)
            assert isinstance(timestamp, float)
            for event in events:
                self.kinds.add(event[0])
                if event[0] == "AllBlocksCleared":
                    self.held.clear()
                elif event[0] == "BlockStored":
                    _, hashes, parent, token_ids, block_size, lora_id, medium = event
                    assert len(token_ids) == block_size * len(hashes) and lora_id is None
                    self.held.update(dict.fromkeys(hashes, medium))
                elif event[0] == "BlockRemoved":
                    _, hashes, medium = event
                    for block_hash in hashes:
                        assert self.held.pop(block_hash) == medium, "removed from a tier it was not in"
                else:
                    self.error = f"unknown event {event[0]}"

    def wait_for(self, seq: int):
        deadline = time.monotonic() + 10
        while self.last_seq < seq and time.monotonic() < deadline:
            time.sleep(0.002)
        assert self.last_seq >= seq, f"batch {seq} never arrived (last {self.last_seq})"

    def close(self):
        self.stop = True
        self.thread.join()
        self.socket.close()
        self.context.term()


def _engine_map(engine) -> dict[int, str]:
    live = {s.seq_id: s.token_ids for s in [*engine.scheduler.running, *engine.scheduler.waiting,
                                            *engine.sessions.sequences()]}
    held = {h: block.tier for h, block in held_blocks(engine.kv, live.get).items()}
    # the hot tier, read a second way: every pool block the prefix cache indexes
    cache = engine.kv.pool.cache
    hot = {cache.key(b)[0] for b in range(engine.kv.num_blocks) if cache.is_cached(b)}
    assert {h for h, tier in held.items() if tier == "hot"} == hot
    return held


def test_a_subscriber_rebuilds_the_held_blocks_from_the_events(tiny_model):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    subscriber = Subscriber(endpoint)
    llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="256KiB", block_size=8, policy="replay+cold", resident_ratio=0.5,
              window_tokens=16, max_num_seqs=4, max_num_batched_tokens=64, replay_threshold=0.02, seed=0,
              kv_events=endpoint)
    engine, rng = llm.engine, random.Random(0)
    time.sleep(0.3)  # the subscriber's connection is up before the first batch (PUB drops until then)
    kept: dict[str, list[int]] = {}
    tally = {"prefix_hit_tokens": 0, "replays": 0, "dropped_tokens": 0, "cold_blocks": 0}
    tiers_seen: set[str] = set()
    try:
        for step in range(160):
            if len(engine.requests) < 4 and rng.random() < 0.5:
                params = SamplingParams(max_tokens=rng.randint(4, 24), temperature=0.0, ignore_eos=True)
                if kept and rng.random() < 0.4:
                    request_id = rng.choice(sorted(kept))
                    prompt = kept.pop(request_id) + rng.sample(range(100, 40000), rng.randint(4, 24))
                    if request_id in engine.sessions and len(prompt) + params.max_tokens < 250:
                        engine.add_request(prompt, params, keep=True, continues=request_id)
                else:
                    head = SHARED[:rng.choice((0, 32, 96))]
                    prompt = head + rng.sample(range(100, 40000), rng.randint(8, 90))
                    engine.add_request(prompt, params, keep=rng.random() < 0.4)
            if engine.requests and rng.random() < 0.03:
                engine.abort_request(rng.choice(sorted(engine.requests)))
            for out in engine.step():
                if out.finished:
                    for key in tally:
                        tally[key] += getattr(out.outputs[0].stats, key)
                    if out.request_id in engine.sessions:
                        kept[out.request_id] = out.prompt_token_ids + out.token_ids
            engine.check_integrity()
            if engine.kv_events.next_seq:
                subscriber.wait_for(engine.kv_events.next_seq - 1)
            expected = _engine_map(engine)
            tiers_seen.update(expected.values())
            assert subscriber.error is None, subscriber.error
            assert subscriber.held == expected, f"step {step}"
    finally:
        subscriber.close()
        engine.kv_events.close()
    # the run did exercise what the events must follow
    assert tally["prefix_hit_tokens"] and tally["replays"] and tally["dropped_tokens"], tally
    assert engine.kv.pool.evictions > 0
    assert tiers_seen == {"hot", "cold", "dropped"}, tiers_seen
    assert subscriber.kinds == {"AllBlocksCleared", "BlockStored", "BlockRemoved"}

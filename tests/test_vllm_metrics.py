"""The router protocol on a real `kvreplay serve` (tiny model): vLLM's series names in /metrics
follow the kvreplay_ series they mirror at every scrape, while requests run, wait and end; and
`--kv-events` publishes the server's blocks over ZMQ."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvreplay.server.launch import free_port
from tests.server_process import serving

PROMPT = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def events_endpoint():
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def server(tiny_model, events_endpoint):
    yield from serving("--model", tiny_model, "--max-num-seqs", "1", "--kv-events", events_endpoint)


def _scrape(server) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name.startswith("vllm:"):
                assert labels == {"model_name": "tiny-llama0", "engine": "0"}, labels
                samples[sample.name] = sample.value
            elif sample.name == "kvreplay_kv_blocks":
                samples[f"blocks_{labels['tier']}_{labels['state']}"] = sample.value
            elif sample.name == "kvreplay_kv_blocks_by_group":
                samples[f"group_{labels['group']}_{labels['state']}"] = sample.value
            elif not labels:
                samples[sample.name] = sample.value
    return samples


def _check_mirrored(s: dict[str, float]) -> None:
    assert s["vllm:num_requests_running"] == s["kvreplay_num_requests_running"]
    assert s["vllm:num_requests_waiting"] == s["kvreplay_num_requests_waiting"]
    used = s["blocks_hot_used"] + s["blocks_reserved_used"]
    assert s["group_global_used"] == s["blocks_hot_used"] and "group_local_used" not in s  # one layer group
    assert s["vllm:kv_cache_usage_perc"] == pytest.approx(used / (used + s["blocks_hot_free"]))
    assert s["vllm:prefix_cache_queries_total"] == s["kvreplay_prompt_tokens_total"]
    assert s["vllm:prefix_cache_hits_total"] == s["kvreplay_prefix_cache_hit_tokens_total"]


def test_vllm_names_move_with_the_kvreplay_series(server):
    before = _scrape(server)
    _check_mirrored(before)
    body = {"model": "tiny-llama0", "prompt": PROMPT, "max_tokens": 64, "temperature": 0,
            "ignore_eos": True}
    threads = [threading.Thread(target=server.post, args=("/v1/completions",), kwargs={"json": body})
               for _ in range(3)]
    for thread in threads:
        thread.start()
    seen = []
    while any(thread.is_alive() for thread in threads):
        seen.append(_scrape(server))
        _check_mirrored(seen[-1])
        time.sleep(0.05)
    after = _scrape(server)
    _check_mirrored(after)
    assert max(s["vllm:num_requests_running"] for s in seen) == 1  # --max-num-seqs 1
    assert max(s["vllm:num_requests_waiting"] for s in seen) >= 1
    assert max(s["vllm:kv_cache_usage_perc"] for s in seen) > 0
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    assert after["vllm:prefix_cache_hits_total"] > before["vllm:prefix_cache_hits_total"]  # same prompt 3x


def test_kv_events_flag_publishes_the_servers_blocks(server, events_endpoint):
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(events_endpoint)
    try:
        time.sleep(0.3)  # subscribed before the request's blocks are published
        stored = set()
        server.post("/v1/completions", json={"model": "tiny-llama0", "prompt": "A new prompt " * 20,
                                             "max_tokens": 4})
        deadline = time.monotonic() + 10
        while not stored and time.monotonic() < deadline:
            if socket.poll(100):
                _, seq, payload = socket.recv_multipart()
                for event in msgpack.unpackb(payload)[1]:
                    if event[0] == "BlockStored":
                        assert event[-1] == "hot" and len(event[3]) == event[4] * len(event[1])
                        stored.update(event[1])
        assert stored
    finally:
        socket.close()
        context.term()

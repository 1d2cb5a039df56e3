"""`kvreplay serve --replicas 2` on a real local Ray cluster (loopback, tiny model): multi-turn
chats resent turn after turn land on the replica that holds their prefix, streamed output equals
the unstreamed, and a replica killed mid-stream ends its stream with an error event (never a hang)
while new requests go to the survivor, until Ray brings a replica back; the pools stay whole. One server for the module (Ray's start is ~20 s)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("zmq")

from tests.server_process import serving  # noqa: E402

NUM_CHATS, NUM_TURNS = 20, 3
REPLICA = "x-kvreplay-replica"


@pytest.fixture(scope="module")
def server(tiny_model):
    for proc in serving("--model", tiny_model, "--replicas", "2", "--kv-cache-memory", "8MiB",
                        "--served-model-name", "tiny", "--debug-endpoints"):
        deadline = time.monotonic() + 120
        while "with 2 replicas" not in proc.log():  # printed once both replicas run
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.2)
        yield proc


def _chat(server, messages, **extra) -> httpx.Response:
    response = server.post("/v1/chat/completions", json={"model": "tiny", "messages": messages,
                                                         "max_tokens": 8, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response


def test_resent_chats_land_on_the_replica_holding_their_prefix(server):
    chats = [[{"role": "system", "content": f"You are assistant number {i}. " * 6}] for i in range(NUM_CHATS)]
    homes = {}
    for turn in range(NUM_TURNS):
        for i, messages in enumerate(chats):
            messages.append({"role": "user", "content": f"Question {turn} of chat {i}: tell me more."})
            response = _chat(server, messages)
            answer = response.json()
            replica = response.headers[REPLICA]
            if turn == 0:
                homes[i] = replica
            else:
                assert replica == homes[i], f"chat {i} turn {turn} moved"
                assert answer["usage"]["kv"]["prefix_hit_tokens"] > 0, answer["usage"]
            messages.append(answer["choices"][0]["message"])
    assert len(set(homes.values())) == 2, homes  # new conversations spread over both replicas


def test_streamed_output_equals_unstreamed(server):
    messages = [{"role": "user", "content": "Stream me a few words about the sea, please."}]
    whole = _chat(server, messages, max_tokens=24).json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 0,
                            "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "") for line in lines[:-1])
    assert text == whole


def test_a_killed_replica_ends_its_streams_and_the_survivor_serves(server):
    body = {"model": "tiny", "prompt": "Once upon a time " * 4, "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    outcome = {}

    def stream():
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as response:
            outcome["replica"] = response.headers[REPLICA]
            outcome["lines"] = [line for line in response.iter_lines() if line]

    thread = threading.Thread(target=stream)
    started = time.monotonic()
    thread.start()
    while "replica" not in outcome:
        assert time.monotonic() - started < 30
        time.sleep(0.05)
    victim = outcome["replica"]
    time.sleep(1.0)  # tokens are flowing
    os.kill(int(victim.rsplit(":", 1)[1]), signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the stream hung after its replica died"
    assert "replica_failed" in outcome["lines"][-1], outcome["lines"][-3:]
    served = []
    for i in range(4):
        response = server.post("/v1/completions", json={"model": "tiny", "prompt": f"After the loss {i}",
                                                         "max_tokens": 4})
        assert response.status_code == 200, response.text
        served.append(response.headers[REPLICA])
    assert victim not in served
    # Ray brings a replica back: new conversations (each 64+ characters, so the router hashes it
    # and spreads it by the new prefixes each replica took) reach a replica that is neither.
    deadline, survivors, i = time.monotonic() + 180, set(served), 0
    while True:
        response = server.post("/v1/completions", json={"model": "tiny", "max_tokens": 2,
                                                         "prompt": f"A new conversation, number {i}, " * 3})
        i += 1
        if response.status_code == 200 and response.headers[REPLICA] not in survivors | {victim}:
            break
        assert time.monotonic() < deadline, f"no replica replaced {victim} after 180 s"
        time.sleep(0.5)
    for _ in range(6):  # every pool that answers (the survivor's or the new one's) is whole
        state = server.get("/debug/kv").json()
        assert state["integrity"] == "ok", state

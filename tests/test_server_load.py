"""The server under load and at shutdown: 64 concurrent streaming clients share one engine loop,
then SIGTERM ends the process cleanly. One real server process (no API key) for the module;
the SIGTERM test stops it, so it runs last."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from server_process import ServerProcess, serving

pytestmark = pytest.mark.slow

NUM_CLIENTS = 64
MAX_TOKENS = 8
SHUTDOWN_TIMEOUT_S = 3
CHAT_PATH = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    # 160MiB holds ~3,600 tokens: all 64 chat requests (~40 tokens each) run in one batch
    yield from serving("--debug-endpoints", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                       kv_cache_memory="160MiB", check_exit=False)


def _counters(server: ServerProcess) -> dict[str, float]:
    return {"http_ok": server.metric("kvreplay_requests_total", f'endpoint="{CHAT_PATH}",status="200"'),
            "finished": server.metric("kvreplay_requests_finished_total"),
            "prompt_tokens": server.metric("kvreplay_prompt_tokens_total"),
            "generation_tokens": server.metric("kvreplay_generation_tokens_total"),
            "steps": server.metric("kvreplay_engine_steps_total")}


async def _one_client(client: openai.AsyncOpenAI, index: int) -> tuple[str, str, object, int]:
    stream = await client.chat.completions.create(
        model="kvreplay-default", messages=[{"role": "user", "content": f"Say the number {index}."}],
        max_tokens=MAX_TOKENS, temperature=0.7, seed=index, stream=True,
        stream_options={"include_usage": True})
    text, finish, usage, num_chunks = "", None, None, 0
    async for chunk in stream:
        num_chunks += 1
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage, num_chunks


def test_64_concurrent_streaming_clients_all_complete(server):
    before = _counters(server)

    async def run_all():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                    max_retries=0, timeout=120)
        async with client:
            return await asyncio.wait_for(
                asyncio.gather(*(_one_client(client, i) for i in range(NUM_CLIENTS))), timeout=240)

    started = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - started
    assert len(results) == NUM_CLIENTS
    for text, finish, usage, num_chunks in results:
        assert finish in ("length", "stop") and usage is not None
        assert 1 <= usage.completion_tokens <= MAX_TOKENS and num_chunks >= usage.completion_tokens
        assert usage.model_extra["kv"]["completion_tokens"] == usage.completion_tokens
    after = _counters(server)
    sent_prompt = sum(usage.prompt_tokens for _, _, usage, _ in results)
    sent_generated = sum(usage.completion_tokens for _, _, usage, _ in results)
    assert after["http_ok"] - before["http_ok"] == NUM_CLIENTS
    assert after["finished"] - before["finished"] == NUM_CLIENTS
    assert after["prompt_tokens"] - before["prompt_tokens"] == sent_prompt
    assert after["generation_tokens"] - before["generation_tokens"] == sent_generated
    # one shared batch: served one by one, the clients would need >= 64 x 8 decode steps
    num_steps = after["steps"] - before["steps"]
    assert num_steps < NUM_CLIENTS * MAX_TOKENS / 4, (num_steps, elapsed)
    server.wait_kv_clean()


def _read_stream(server: ServerProcess, result: dict, first_data: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True,
            "temperature": 0}
    try:
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    first_data.set()
                    for choice in json.loads(line[6:]).get("choices", []):
                        result["finish"] = choice["finish_reason"] or result.get("finish")
                elif line == "data: [DONE]":
                    result["done"] = True
    except Exception as exc:  # noqa: BLE001 - the assertion below reports it
        result["error"] = repr(exc)
    finally:
        first_data.set()


def test_sigterm_stops_accepting_ends_streams_and_exits_0(server):
    """Runs last: it stops the module's server."""
    results = [{} for _ in range(3)]
    ready = [threading.Event() for _ in results]
    threads = [threading.Thread(target=_read_stream, args=(server, result, event), daemon=True)
               for result, event in zip(results, ready)]
    for thread in threads:
        thread.start()
    for event in ready:
        assert event.wait(60)
    server.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    time.sleep(0.5)
    # the port stays open while draining: load balancers see 503, not a refused connection
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 503
    for thread in threads:
        thread.join(timeout=30)
    # streams 1,000 tokens long cannot finish in the grace period: each gets a final chunk
    for result in results:
        assert result == {"finish": "length", "done": True}, result
    assert server.process.wait(timeout=30) == 0, server.log()
    assert time.monotonic() - signalled < SHUTDOWN_TIMEOUT_S + 10
    assert "Traceback" not in server.log(), server.log()

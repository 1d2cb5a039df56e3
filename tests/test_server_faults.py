"""Faults a hostile or unlucky client found in the server (issue 39, items 1-6), each against one
real `kvreplay serve` process: a dropped non-streamed request, big pastes stalling streams, SIGTERM
closing the port, 429 without Retry-After and unbounded fan-out, the Authorization header's
scheme and duplicates, /metrics for scrapers, misleading messages. The SIGTERM test stops the
module's server, so it runs last."""
from __future__ import annotations

import json
import signal
import statistics
import threading
import time

import httpx
import pytest

from kvreplay import SamplingParams
from kvreplay.server.protocol import MAX_PROMPTS
from server_process import ServerProcess, serving

pytestmark = pytest.mark.slow

API_KEY = "faults-key"
MAX_QUEUED_SEQS = 4
MAX_SEQS_PER_REQUEST = 2
SHUTDOWN_TIMEOUT_S = 2
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
PASTE = "hello " * 150_000  # 900 KB: under the 1 MiB body limit, far over the context


@pytest.fixture(scope="module")
def server():
    # 160MiB holds ~3,600 tokens: the SIGTERM test's two long streams run side by side
    yield from serving("--debug-endpoints", "--max-queued-seqs", str(MAX_QUEUED_SEQS),
                       "--max-seqs-per-request", str(MAX_SEQS_PER_REQUEST),
                       "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--metrics-public",
                       "--no-docs", "--no-console", kv_cache_memory="160MiB", api_key=API_KEY,
                       check_exit=False)


def _requests_total(server: ServerProcess, path: str, status: int) -> float:
    return server.metric("kvreplay_requests_total", f'endpoint="{path}",status="{status}"')


def _stream(server: ServerProcess, body: dict, result: dict, first_data: threading.Event) -> None:
    """Read one SSE stream into `result`: arrival time of each chunk, finish and stop reasons,
    whether [DONE] came; `first_data` is set at the first chunk (or on any error)."""
    result.update(times=[], done=False)
    try:
        with httpx.stream("POST", server.base_url + COMPLETIONS_PATH, json={**body, "stream": True},
                          headers=server.headers, timeout=60) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    result["times"].append(time.monotonic())
                    first_data.set()
                    for choice in json.loads(line[6:]).get("choices", []):
                        if choice["finish_reason"]:
                            result["finish"] = choice["finish_reason"]
                            result["stop_reason"] = choice.get("stop_reason")
                elif line == "data: [DONE]":
                    result["done"] = True
    except Exception as exc:  # noqa: BLE001 - the test's assertions report it
        result["error"] = repr(exc)
    finally:
        first_data.set()


def _start_streams(server: ServerProcess, bodies: list[dict]) -> tuple[list[dict], list[threading.Thread]]:
    results = [{} for _ in bodies]
    ready = [threading.Event() for _ in bodies]
    threads = [threading.Thread(target=_stream, args=(server, body, result, event), daemon=True)
               for body, result, event in zip(bodies, results, ready)]
    for thread in threads:
        thread.start()
    for event in ready:
        assert event.wait(60)
    return results, threads


def _assert_openai_error(response: httpx.Response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == error_type, error
    return error


# ---------------------------------------------------------------- 1. a dropped non-streamed request

def test_a_dropped_non_streamed_request_is_counted_not_a_500(server):
    before = {status: _requests_total(server, COMPLETIONS_PATH, status) for status in (499, 500)}
    aborted_before = server.metric("kvreplay_requests_aborted_total")
    body = {"prompt": "Tell me", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        server.post(COMPLETIONS_PATH, json=body, timeout=1.0)
    deadline = time.monotonic() + 15
    while _requests_total(server, COMPLETIONS_PATH, 499) < before[499] + 1:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    server.wait_kv_clean()  # the engine request was aborted: its blocks are free
    assert server.metric("kvreplay_requests_aborted_total") == aborted_before + 1
    assert _requests_total(server, COMPLETIONS_PATH, 500) == before[500]
    log = server.log()
    assert "InvalidStateError" not in log and "Exception in ASGI application" not in log, log[-3000:]


# ---------------------------------------------------------------- 2. big pastes and other streams

def test_big_pastes_are_refused_without_stalling_a_stream(server):
    """Three ~1 MB bodies (answered 4xx, far over the context) while a stream runs: its tokens
    keep coming at their usual pace (they stalled for seconds while the engine thread
    tokenized the pastes)."""
    results, threads = _start_streams(server, [{"prompt": "Once upon a time", "max_tokens": 120,
                                                "ignore_eos": True, "temperature": 0}])
    while len(results[0]["times"]) < 10 and threads[0].is_alive():
        time.sleep(0.01)
    bodies = [(CHAT_PATH, {"messages": [{"role": "user", "content": PASTE}], "max_tokens": 4}),
              (CHAT_PATH, {"messages": [{"role": "system", "content": PASTE},
                                        {"role": "user", "content": "Summarize."}]}),
              (COMPLETIONS_PATH, {"prompt": PASTE, "max_tokens": 4})]
    answers: list[httpx.Response | None] = [None] * len(bodies)

    def post(i: int) -> None:
        path, body = bodies[i]
        answers[i] = server.post(path, json=body, timeout=60)
    posters = [threading.Thread(target=post, args=(i,), daemon=True) for i in range(len(bodies))]
    for poster in posters:
        poster.start()
    for poster in posters:
        poster.join(60)
    threads[0].join(120)
    stream = results[0]
    assert stream.get("finish") == "length" and stream["done"], stream.get("error")
    for (path, _), answer in zip(bodies, answers):
        assert answer is not None and answer.status_code in (400, 413), (path, answer)
        _assert_openai_error(answer, answer.status_code, "invalid_request_error")
    gaps = [later - earlier for earlier, later in zip(stream["times"][2:], stream["times"][3:])]
    median = statistics.median(gaps)
    assert max(gaps) < max(10 * median, 1.0), (max(gaps), median)


# ---------------------------------------------------------------- 4. 429 and fan-out

def test_fan_out_is_bounded_per_request_and_429_says_when_to_retry(server):
    short = {"prompt": "Hello", "max_tokens": 2}
    # one request may not take more than its share, even where the queue has room for it
    error = _assert_openai_error(server.post(COMPLETIONS_PATH, json={**short, "n": 3}), 400,
                                 "invalid_request_error")
    assert f"at most {MAX_SEQS_PER_REQUEST} per request" in error["message"], error
    assert server.post(COMPLETIONS_PATH, json={**short, "prompt": ["Hi", "Hello"]}).status_code == 200
    # two requests of two sequences fill the queue: the next one gets 429 and Retry-After
    long = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "n": 2, "temperature": 1.0,
            "stream": True}
    url = server.base_url + COMPLETIONS_PATH
    with httpx.stream("POST", url, json=long, headers=server.headers, timeout=60) as first, \
            httpx.stream("POST", url, json=long, headers=server.headers, timeout=60) as second:
        assert first.status_code == second.status_code == 200
        lines = [first.iter_lines(), second.iter_lines()]  # keep them: a collected one closes
        for line in lines:
            next(line)
        refused = server.post(COMPLETIONS_PATH, json=short)
        error = _assert_openai_error(refused, 429, "rate_limit_error")
        assert error["code"] == "queue_full"
        assert int(refused.headers["retry-after"]) >= 1, refused.headers
    server.wait_kv_clean()


# ---------------------------------------------------------------- 5. auth header, /metrics

def test_the_bearer_scheme_is_case_insensitive_and_duplicates_are_refused(server):
    plain = httpx.Client(base_url=server.base_url, timeout=30)
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        response = plain.get("/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
        assert response.status_code == 200, (scheme, response.text)
    for values in ([f"Bearer {API_KEY}", "Bearer wrong"], ["Bearer wrong", f"Bearer {API_KEY}"],
                   [f"Bearer {API_KEY}"] * 2):
        response = plain.get("/v1/models", headers=[("Authorization", value) for value in values])
        error = _assert_openai_error(response, 400, "invalid_request_error")
        assert "Authorization" in error["message"], error
    assert plain.get("/v1/models", headers={"Authorization": "Basic " + API_KEY}).status_code == 401


def test_metrics_public_opens_metrics_only(server):
    plain = httpx.Client(base_url=server.base_url, timeout=30)
    metrics = plain.get("/metrics")
    assert metrics.status_code == 200 and "kvreplay_requests_total" in metrics.text
    for path in ("/v1/models", "/debug/kv"):
        assert plain.get(path).status_code == 401, path


# ---------------------------------------------------------------- 6. clear messages

@pytest.mark.parametrize("path,body,words", [
    (COMPLETIONS_PATH, {"prompt": ["Hello"] * (MAX_PROMPTS + 1)}, f"at most {MAX_PROMPTS} prompts"),
    (COMPLETIONS_PATH, {"prompt": [[1, 2]] * (MAX_PROMPTS + 1)}, f"at most {MAX_PROMPTS} prompts"),
    (COMPLETIONS_PATH, {"prompt": "Hello", "seed": 2 ** 64}, "seed must be"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": "Hi"}], "seed": 2 ** 63}, "seed must be"),
    (COMPLETIONS_PATH, {"prompt": "Hello", "stop_token_ids": [10 ** 12]}, "stop_token_ids"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": "Hi"}], "stop_token_ids": [2, 10 ** 6]},
     "stop_token_ids"),
])
def test_bad_values_get_messages_that_name_them(server, path, body, words):
    error = _assert_openai_error(server.post(path, json=body), 400, "invalid_request_error")
    assert words in error["message"], error


def test_no_docs_turns_the_openapi_docs_off(server):
    """--no-docs: /docs and /openapi.json are neither open nor served (/version still is)."""
    plain = httpx.Client(base_url=server.base_url, timeout=30)
    for path in ("/docs", "/openapi.json", "/docs/static/swagger-ui.css"):
        assert plain.get(path).status_code == 401  # no longer an open path
        _assert_openai_error(server.get(path), 404, "invalid_request_error")
    assert plain.get("/version").status_code == 200


def test_no_console_turns_the_web_console_off(server):
    """--no-console: /, /console and its files are neither open nor served; /v1/kv/state stays
    an API route behind the key."""
    plain = httpx.Client(base_url=server.base_url, timeout=30)
    for path in ("/", "/console", "/console/console.js"):
        assert plain.get(path).status_code == 401
        _assert_openai_error(server.get(path), 404, "invalid_request_error")
    assert plain.get("/v1/kv/state").status_code == 401
    assert server.get("/v1/kv/state").json()["pool"]["num_blocks"] > 0


def test_the_largest_seed_is_served(server):
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 1.0, "seed": 2 ** 63 - 1}
    assert server.post(COMPLETIONS_PATH, json=body).status_code == 200


def test_llm_refuses_unknown_roles_and_stop_ids_outside_the_vocabulary(llm32):
    with pytest.raises(ValueError, match="unknown chat role 'wizard'"):
        llm32.chat([{"role": "wizard", "content": "hi"}], SamplingParams(max_tokens=2))
    vocab_size = llm32.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm32.generate("Hello", SamplingParams(max_tokens=2, stop_token_ids=[vocab_size]))
    with pytest.raises(ValueError, match="seed must be"):
        SamplingParams(seed=2 ** 64)
    assert not llm32.engine.has_unfinished_requests()


# ---------------------------------------------------------------- 3. SIGTERM (runs last)

def test_sigterm_drains_with_the_port_open_and_cut_streams_say_why(server):
    """Runs last: it stops the module's server. During the drain the port stays open: /health
    and new work answer 503; streams that outlive the drain end with finish_reason "length" and
    stop_reason "shutdown"; then the process exits 0."""
    long = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    results, threads = _start_streams(server, [long, long])
    server.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    time.sleep(0.3)
    health = httpx.get(server.base_url + "/health", timeout=5)
    assert health.status_code == 503 and health.json() == {"status": "shutting down"}
    _assert_openai_error(server.post(COMPLETIONS_PATH, json={"prompt": "Hi", "max_tokens": 2}), 503,
                         "service_unavailable_error")
    for thread in threads:
        thread.join(timeout=30)
    for result in results:
        assert result.get("error") is None and result["done"], result.get("error")
        assert (result.get("finish"), result.get("stop_reason")) == ("length", "shutdown"), result
    assert server.process.wait(timeout=30) == 0, server.log()[-3000:]
    assert time.monotonic() - signalled < SHUTDOWN_TIMEOUT_S + 10
    assert "Traceback" not in server.log(), server.log()[-3000:]

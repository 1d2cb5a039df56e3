"""The OpenAI-compatible server, end to end: one real `kvreplay serve` process (fp32, API key,
debug endpoint, a small queue) driven by the official `openai` client and raw HTTP."""
from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from kvreplay import SamplingParams
from server_process import serving

pytestmark = pytest.mark.slow

API_KEY = "test-key-123"
MAX_QUEUED_SEQS = 8
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
CHAT_PATH = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    yield from serving("--debug-endpoints", "--max-queued-seqs", str(MAX_QUEUED_SEQS),
                       "--served-model-name", "tiny", api_key=API_KEY)


@pytest.fixture(scope="module")
def reference(llm32):
    """What LLM.chat / LLM.generate make greedily in this process, for the server to match."""
    return {"chat": llm32.chat(CHAT, SamplingParams(max_tokens=12, temperature=0)),
            "text": llm32.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0))}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _stream_text(stream, field: str):
    """Concatenated text per choice, finish reasons per choice, and the usage chunk."""
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if field == "delta" else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, usage


# ---------------------------------------------------------------- auth, models, health

def test_api_key_guards_every_route_but_health(server):
    plain = httpx.Client(base_url=server.base_url, timeout=30)
    assert plain.get("/health").json() == {"status": "ok"}
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/debug/kv"),
                         ("POST", CHAT_PATH), ("POST", "/v1/completions"), ("POST", "/v1/tokenize"),
                         ("POST", "/v1/detokenize"), ("POST", "/tokenize")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            response = plain.request(method, path, headers=headers, json={"prompt": "x"})
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


# ---------------------------------------------------------------- exact output

def test_greedy_chat_and_completion_equal_llm_generate(client, reference):
    chat_ref = reference["chat"]
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == chat_ref.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == chat_ref.finish_reason
    assert reply.usage.prompt_tokens == len(chat_ref.prompt_token_ids)
    assert reply.usage.completion_tokens == len(chat_ref.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    kv = reply.usage.model_extra["kv"]
    assert kv["prompt_tokens"] == reply.usage.prompt_tokens and kv["preemptions"] == 0
    assert set(chat_ref.stats.as_dict()) <= set(kv)

    text_ref = reference["text"]
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    assert done.choices[0].text == text_ref.text
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, 10)
    # token-id prompts are served the same
    by_ids = client.completions.create(model="tiny", prompt=text_ref.prompt_token_ids, max_tokens=10,
                                       temperature=0)
    assert by_ids.choices[0].text == text_ref.text


def test_streaming_equals_non_streaming(client, reference):
    chat_ref = reference["chat"]
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    num_tokens = len(chat_ref.token_ids)
    assert len(chunks) >= num_tokens  # tokens stream as they are made, not in one piece
    texts, finish, usage = _stream_text(iter(chunks), "delta")
    assert texts == {0: chat_ref.text} and finish == {0: chat_ref.finish_reason}
    assert usage.completion_tokens == num_tokens
    assert usage.prompt_tokens == len(chat_ref.prompt_token_ids)
    assert usage.model_extra["kv"]["completion_tokens"] == num_tokens

    text_ref = reference["text"]
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                       stream=True)
    texts, finish, usage = _stream_text(stream, "text")
    assert texts == {0: text_ref.text} and finish == {0: "length"} and usage is None


def test_raw_sse_framing(server):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=server.headers,
                      timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in events[:-1]]
    assert [p["object"] for p in payloads] == ["text_completion"] * 3
    assert len({p["id"] for p in payloads}) == 1


# ---------------------------------------------------------------- n, stop, seed, logprobs

def test_n2_streamed_and_not(client):
    sampling = dict(model="tiny", messages=CHAT, max_tokens=8, n=2, temperature=1.0, seed=7,
                    extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(**sampling)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content != reply.choices[1].message.content  # seeds 7 and 8
    assert reply.usage.completion_tokens == 16
    stream = client.chat.completions.create(**sampling, stream=True)
    texts, finish, _ = _stream_text(stream, "delta")
    assert texts == {c.index: c.message.content for c in reply.choices}
    assert finish == {0: "length", 1: "length"}
    # batch of prompts x n: choices are numbered prompt-major
    done = client.completions.create(model="tiny", prompt=[PROMPT, "Hello"], max_tokens=4, n=2,
                                     temperature=0)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert done.choices[0].text == done.choices[1].text != done.choices[2].text
    assert done.usage.prompt_tokens == 5 + 1 and done.usage.completion_tokens == 16


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0,
                                         seed=seed).choices[0].text
    assert sample(11) == sample(11)


def test_stop_strings_streamed_and_not(client, reference):
    full = reference["text"].text
    assert full.startswith(" Paris.\n\nThe answer")
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                     stop=["."])
    assert (done.choices[0].text, done.choices[0].finish_reason) == (" Paris", "stop")
    # a stop string made of several tokens: "\n" and "\n\n" are held back while they could
    # still grow into it, so the stream never sends text the final answer drops
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                       stop=["\n\nThe", "zzz"], stream=True)
    texts, finish, _ = _stream_text(stream, "text")
    assert texts == {0: " Paris."} and finish == {0: "stop"}


def test_logprobs_chat_and_completion(client):
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    assert "".join(item.token for item in content) == reply.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 3
        values = [top.logprob for top in item.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert item.top_logprobs[0].token == item.token and item.logprob == values[0]  # greedy
        assert bytes(item.bytes).decode() == item.token

    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                     logprobs=2)
    logprobs = done.choices[0].logprobs
    assert "".join(logprobs.tokens) == done.choices[0].text
    assert len(logprobs.token_logprobs) == 5 and all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[1] == len(logprobs.tokens[0])

    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                       logprobs=2, stream=True)
    streamed = [t for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert streamed == logprobs.tokens


# ---------------------------------------------------------------- bad input

BAD_CHAT = [
    ({"messages": CHAT, "max_tokens": -1}, 400),
    ({"messages": CHAT, "max_tokens": 0}, 400),
    ({"messages": CHAT, "max_tokens": "8"}, 400),          # wrong type
    ({"messages": CHAT, "max_tokens": 10 ** 9}, 400),      # beyond the context
    ({"messages": CHAT, "temperature": "hot"}, 400),
    ({"messages": CHAT, "top_p": 1.5}, 400),
    ({"messages": CHAT, "top_p": 0}, 400),
    ({"messages": CHAT, "n": 0}, 400),
    ({"messages": CHAT, "n": 1000}, 400),                  # bounded
    ({"messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400),
    ({"messages": CHAT, "stop": "x" * 10_000}, 400),
    ({"messages": CHAT, "top_logprobs": 50, "logprobs": True}, 400),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, 400),
    ({"messages": CHAT, "seed": -1}, 400),
    ({"messages": []}, 400),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ({"messages": "hello"}, 400),
    ({"messages": CHAT, "model": "gpt-4"}, 404),
    ({}, 400),
]
BAD_COMPLETION = [
    ({"prompt": ""}, 400),
    ({"prompt": []}, 400),
    ({"prompt": [10 ** 9]}, 400),                          # token id outside the vocabulary
    ({"prompt": "hello " * 9000}, 400),                    # longer than the context
    ({"prompt": "hello " * 2000}, 400),                    # longer than the 64MiB KV pool
    ({"prompt": [PROMPT] * 100}, 400),                     # too many prompts
    ({"prompt": PROMPT, "logprobs": -1}, 400),
    ({"prompt": PROMPT, "echo": True}, 400),
    ({"prompt": 42}, 400),
]


@pytest.mark.parametrize("path,body,status", [(CHAT_PATH, b, s) for b, s in BAD_CHAT]
                         + [("/v1/completions", b, s) for b, s in BAD_COMPLETION])
def test_bad_input_gets_4xx_in_openai_shape(server, path, body, status):
    response = server.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"


def test_bad_requests_leave_the_server_serving(server, client):
    for raw in [b"not json", b"[1, 2]", b"{\"messages\": ", b"\xff\xfe"]:
        response = server.post(CHAT_PATH, content=raw)
        assert response.status_code == 400, response.text
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    assert server.post("/v1/completions", content=big).status_code == 413
    assert server.get("/no/such/route").status_code == 404
    assert server.get("/v1/completions").status_code == 405
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert reply.usage.completion_tokens == 2
    assert server.metric("kvreplay_requests_total", f'endpoint="{CHAT_PATH}",status="500"') == 0
    server.wait_kv_clean()


# ---------------------------------------------------------------- startup line, tokenizer, version, docs

def test_the_startup_log_states_the_kv_pool_policy_and_kernels(server):
    log = server.log()
    num_blocks = server.get("/debug/kv").json()["num_blocks"]
    for words in ("ready in", f"KV cache: ", f"= {num_blocks:,} blocks x 16 tokens = "
                  f"{num_blocks * 16:,} tokens, 46,080 bytes per token",  # fp32: 30 x 2 x 3 x 64 x 4
                  f"max concurrency at 8,192 tokens per request: {num_blocks / 512:.2f}x",
                  "policy full: watermarks 0.6/0.7/0.85", "threads; compiled CPU kernels"):
        assert words in log, (words, log[-3000:])


def test_tokenize_counts_what_generation_queues(server, client):
    chat = server.post("/v1/tokenize", json={"messages": CHAT}).json()
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
    assert chat["count"] == len(chat["tokens"]) == reply.usage.prompt_tokens
    assert chat["max_model_len"] == 8192
    text = server.post("/v1/tokenize", json={"prompt": PROMPT, "model": "tiny"}).json()
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
    assert text["count"] == completion.usage.prompt_tokens
    assert server.post("/tokenize", json={"prompt": PROMPT}).json() == text  # vLLM's path too
    bare = server.post("/v1/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert server.post("/v1/detokenize", json={"tokens": bare["tokens"]}).json() == {"prompt": PROMPT}
    # the chat template's text, its special tokens included; without the assistant's header
    shown = server.post("/v1/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert "<|im_start|>user\nName three colors.<|im_end|>" in shown
    assert shown.endswith("<|im_start|>assistant\n")
    no_header = server.post("/v1/tokenize", json={"messages": CHAT, "add_generation_prompt": False})
    assert no_header.json()["count"] < chat["count"]


BAD_TOKENIZE = [
    ("/v1/tokenize", {}, 400, "either 'prompt'"),
    ("/v1/tokenize", {"prompt": PROMPT, "messages": CHAT}, 400, "not both"),
    ("/v1/tokenize", {"prompt": 42}, 400, "prompt"),
    ("/v1/tokenize", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/tokenize", {"messages": []}, 400, "messages"),
    ("/v1/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/tokenize", {"prompt": PROMPT, "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/v1/tokenize", {"prompt": PROMPT, "temperature": 1}, 400, "temperature"),
    ("/v1/tokenize", {"prompt": PROMPT, "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/tokenize", {"prompt": "hello " * 30000}, 400, "max_prompt_bytes"),
    ("/v1/detokenize", {}, 400, "tokens"),
    ("/v1/detokenize", {"tokens": "hello"}, 400, "tokens"),
    ("/v1/detokenize", {"tokens": [1, True]}, 400, "tokens"),
    ("/v1/detokenize", {"tokens": [-1]}, 400, "token ids must be in [0, 49152)"),
    ("/v1/detokenize", {"tokens": [10 ** 9]}, 400, "token ids must be in [0, 49152)"),
    ("/v1/detokenize", {"tokens": [1.5]}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,words", BAD_TOKENIZE)
def test_bad_tokenizer_requests_get_4xx_in_openai_shape(server, path, body, status, words):
    response = server.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error", error


def test_tokenizer_routes_refuse_raw_garbage_and_keep_serving(server):
    for path in ("/v1/tokenize", "/v1/detokenize"):
        for raw in [b"not json", b"[1, 2]", b"\xff\xfe"]:
            assert server.post(path, content=raw).status_code == 400
        assert server.post(path, content=b'{"prompt": "' + b"a" * (2 << 20) + b'"}').status_code == 413
        assert server.get(path).status_code == 405
    assert server.post("/v1/tokenize", json={"prompt": "ok"}).json()["count"] >= 1
    assert server.metric("kvreplay_requests_total", f'endpoint="{CHAT_PATH}",status="500"') == 0


def test_version_and_docs_are_served_without_the_key(server):
    plain = httpx.Client(base_url=server.base_url, timeout=30)
    import kvreplay
    assert plain.get("/version").json() == {"version": kvreplay.__version__}
    page = plain.get("/docs")
    assert page.status_code == 200 and "swagger-ui" in page.text
    # the page loads its scripts from this server (no CDN: it must render offline)
    sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sources and all(src.startswith("/docs/static/") for src in sources), sources
    for src in sources:
        assert plain.get(src).status_code == 200, src
    schema = plain.get("/openapi.json").json()
    assert {"/v1/tokenize", "/v1/detokenize", "/v1/chat/completions", "/version"} <= set(schema["paths"])
    assert schema["info"]["version"] == kvreplay.__version__


# ---------------------------------------------------------------- disconnects and admission

def test_client_dropping_mid_stream_frees_its_blocks(server):
    aborted_before = server.metric("kvreplay_requests_aborted_total")
    body = {"prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=server.headers,
                      timeout=60) as response:
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6)) if line.startswith("data: {")) >= 3
        assert server.get("/debug/kv").json()["num_used_blocks"] > 0
    # leaving the block closed the connection mid-stream
    server.wait_kv_clean()
    assert server.metric("kvreplay_requests_aborted_total") == aborted_before + 1


def test_client_dropping_a_non_streamed_request_frees_its_blocks(server):
    aborted_before = server.metric("kvreplay_requests_aborted_total")
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", json=body, timeout=1.5)
    server.wait_kv_clean()
    assert server.metric("kvreplay_requests_aborted_total") == aborted_before + 1


def test_full_queue_answers_429_at_once(server, client):
    body = {"prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True,
            "n": MAX_QUEUED_SEQS, "temperature": 1.0}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=server.headers,
                      timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as excinfo:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert time.monotonic() - started < 5
        assert excinfo.value.response.json()["error"]["code"] == "queue_full"
    server.wait_kv_clean()
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices[0].text


def test_metrics_expose_the_spec_names(server):
    text = server.get("/metrics").text
    for name in ["kvreplay_kv_usage_ratio{tier=\"hot\"}", "kvreplay_num_requests_running",
                 "kvreplay_num_requests_waiting", "kvreplay_prompt_tokens_total",
                 "kvreplay_generation_tokens_total", "kvreplay_requests_total",
                 "kvreplay_time_to_first_token_seconds_bucket",
                 "kvreplay_time_per_output_token_seconds_bucket", "kvreplay_pauses_total",
                 "kvreplay_replays_total", "kvreplay_replayed_tokens_total", "kvreplay_dropped_tokens_total",
                 "kvreplay_prefix_cache_hit_tokens_total", "kvreplay_replay_mismatches_total",
                 "kvreplay_cold_blocks_total", "kvreplay_preemptions_total",
                 "kvreplay_kv_usage_ratio{tier=\"cold\"}", "kvreplay_kv_usage_ratio{tier=\"index\"}",
                 "kvreplay_sparse_hit_rate", "kvreplay_hot_cold_access_ratio", "kvreplay_dequant_time_share",
                 "kvreplay_sparse_selected_blocks_total", "kvreplay_hot_blocks_read_total"]:
        assert name in text, name
    assert server.metric("kvreplay_requests_total", f'endpoint="{CHAT_PATH}",status="401"') > 0
    assert server.metric("kvreplay_time_to_first_token_seconds_count") > 0


def test_cold_tier_gauges_are_computed_from_the_snapshot():
    """Sparse hit rate, hot/cold access ratio, dequant share and per-tier usage from one
    published snapshot (the engine-side counters they divide)."""
    from kvreplay.server.generation import EngineSnapshot
    from kvreplay.server.metrics import ServerMetrics
    snap = EngineSnapshot(num_blocks=100, num_used_blocks=50, num_index_blocks=10, block_bytes=1000,
                          index_bytes=4000, cold_bytes=5500,
                          counters={"sparse_selected_blocks": 30, "sparse_candidate_blocks": 120,
                                    "hot_blocks_read": 90, "dequant_seconds": 0.5, "decode_seconds": 2.0})
    text = ServerMetrics(lambda: snap).render().decode()

    def value(line_start: str) -> float:
        return float(next(line for line in text.splitlines() if line.startswith(line_start)).split()[-1])

    assert value("kvreplay_sparse_hit_rate ") == 0.25
    assert value("kvreplay_hot_cold_access_ratio ") == 3.0
    assert value("kvreplay_dequant_time_share ") == 0.25
    assert value('kvreplay_kv_usage_ratio{tier="hot"}') == 0.4
    assert value('kvreplay_kv_usage_ratio{tier="index"}') == 0.04
    assert value('kvreplay_kv_usage_ratio{tier="cold"}') == 0.055
    empty = ServerMetrics(lambda: EngineSnapshot()).render().decode()
    assert "kvreplay_hot_cold_access_ratio 0.0" in empty  # no cold read yet: 0, not a division error

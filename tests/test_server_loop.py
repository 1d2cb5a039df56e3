"""The server's engine loop against a scripted fake engine (no model, fast): outputs reach the
right client, and an engine that crashes turns into 503s instead of hung requests."""
from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient

from kvreplay.engine.llm_engine import EngineCounters
from kvreplay.outputs import RequestStats
from kvreplay.outputs import CompletionOutput, RequestOutput
from kvreplay.server.app import build_app
from kvreplay.server.async_engine import AsyncEngine
from kvreplay.server.config import ServerConfig


class FakeTokenizer:
    def decode(self, token_ids):
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


class FakeEngine:
    """Every prompt is 3 tokens; each step appends token i to every request's output."""
    max_model_len = 64

    def __init__(self, crash_on_step: bool = False):
        self.crash_on_step = crash_on_step
        self.kv = SimpleNamespace(num_blocks=4, num_used_blocks=0, num_reserved_blocks=0, capacity_tokens=64,
                                  block_bytes=16, index_bytes=0, cold_bytes=0, tier_io=None,
                                  local=SimpleNamespace(blocks_by_group=lambda: {"global": {"used": 0, "cached": 0}}))
        self.counters = EngineCounters()
        self.requests: dict[str, tuple[object, list[int]]] = {}
        self.num_waiting = 0
        self.protected: dict[str, int] = {}
        self.hot_from: dict[str, int | None] = {}

    @property
    def num_running(self):
        return len(self.requests)

    def tokenize(self, prompt):
        return [0, 1, 2] if prompt else []

    def add_request(self, token_ids, params, request_id, stream, protected_tokens=0, hot_from=None):
        if not token_ids:
            raise ValueError("the prompt is empty")
        self.requests[request_id] = (params, [])
        self.protected[request_id] = protected_tokens
        self.hot_from[request_id] = hot_from

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        if self.crash_on_step:
            raise RuntimeError("boom")
        outputs = []
        for request_id, (params, tokens) in list(self.requests.items()):
            tokens.append(len(tokens))
            done = len(tokens) >= params.max_tokens
            if done:
                del self.requests[request_id]
            outputs.append(self._output(request_id, tokens, "length" if done else None))
        return outputs

    def abort_request(self, request_id):
        params, tokens = self.requests.pop(request_id, (None, None))
        return None if params is None else self._output(request_id, tokens, "abort")

    @staticmethod
    def _output(request_id, tokens, finish_reason):
        completion = CompletionOutput(0, FakeTokenizer().decode(tokens), list(tokens), finish_reason,
                                      None, RequestStats(prompt_tokens=3, completion_tokens=len(tokens)))
        return RequestOutput(request_id, None, [0, 1, 2], [completion], finished=finish_reason is not None)


def _client(engine: FakeEngine) -> TestClient:
    template = SimpleNamespace(tokenizer=FakeTokenizer(), chat_prompt_ids=lambda c, tools=None: [0, 1, 2],
                               tokenize=engine.tokenize,
                               system_span_tokens=lambda c: 2 if c[0]["role"] == "system" else 0,
                               recent_rounds_start=lambda c: 1 if len(c) > 3 else None)
    template.private_copy = lambda: template
    engine.chat_template = template
    llm = SimpleNamespace(engine=engine, tokenizer=template.tokenizer)
    return TestClient(build_app(AsyncEngine(llm), ServerConfig()))


def test_outputs_reach_their_clients():
    with _client(FakeEngine()) as client:
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "n": 1})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"] == "abcd" and body["usage"]["completion_tokens"] == 4
        with client.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as stream:
            lines = [line for line in stream.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) == 1 + 3 + 1  # role, 3 tokens, done
        assert client.post("/v1/completions", json={"prompt": ""}).status_code == 400


def test_a_crashed_engine_answers_503_not_a_hang():
    with _client(FakeEngine(crash_on_step=True)) as client:
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert response.status_code == 503 and "boom" in response.json()["error"]["message"]
        assert client.get("/health").status_code == 503
        again = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert again.status_code == 503


def test_a_chat_system_message_is_passed_as_the_protected_zone():
    engine = FakeEngine()
    with _client(engine) as client:
        for messages in ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                         [{"role": "user", "content": "hi"}]):
            response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
            assert response.status_code == 200, response.text
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        rounds = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 2
        response = client.post("/v1/chat/completions", json={"messages": rounds, "max_tokens": 2})
        assert response.status_code == 200, response.text
    assert sorted(engine.protected.values()) == [0, 0, 0, 2]
    # ... and where a chat's last rounds start (LLM.recent_rounds_start), None for a completion
    assert sorted(engine.hot_from.values(), key=str) == [1, None, None, None]

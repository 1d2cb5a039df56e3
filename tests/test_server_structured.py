"""Structured output and tool calling through a real `kvreplay serve` process: response_format on
both endpoints (the official `openai` client), clear 400s for bad formats and schemas, and tools
refused for SmolLM2's own chat template, which renders none, and served with the shipped
`chatml-tools` template (`--chat-template`)."""
from __future__ import annotations

import json

import openai
import pytest

from server_process import serving

pytestmark = pytest.mark.slow

CHAT_PATH = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": 'Reply only with a compact JSON object, such as {"title": "Dune", '
                                      '"year": 1965}. Keep every value under five words.'}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}}}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "required": ["city"],
                                                        "properties": {"city": {"type": "string", "maxLength": 40}}}}}


@pytest.fixture(scope="module")
def server():
    yield from serving("--served-model-name", "x")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_json_object_and_schema(client):
    reply = client.chat.completions.create(
        model="x", messages=[SYSTEM, {"role": "user", "content": "Describe a cat in JSON."}], max_tokens=96,
        temperature=0, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    reply = client.chat.completions.create(
        model="x", messages=[SYSTEM, {"role": "user", "content": "Describe a fictional person in JSON."}], max_tokens=64,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert set(PERSON["required"]) <= set(json.loads(reply.choices[0].message.content))


def test_completions_json_schema_streamed(client):
    stream = client.completions.create(
        model="x", prompt="A person described in JSON:", max_tokens=64, temperature=0, stream=True,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    text = "".join(choice.text for chunk in stream for choice in chunk.choices)
    assert set(PERSON["required"]) <= set(json.loads(text))


@pytest.mark.parametrize("response_format, message", [
    ("json", "should be an object"),
    ({"type": "yaml"}, "response_format.type must be one of"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "Invalid type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
     "regex parse error"),
])
def test_bad_response_formats_get_a_400_naming_the_field(server, response_format, message):
    for path, body in ((CHAT_PATH, {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        response = server.post(path, json={**body, "response_format": response_format})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error["message"] and error["param"] == "response_format", error


def test_tools_are_refused_for_a_template_without_them(server, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Weather?"}],
                                       tools=[TOOL], max_tokens=8)
    error = caught.value.body
    assert "does not take tools" in error["message"] and error["param"] == "tools"
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        response = server.post(CHAT_PATH, json={"messages": [{"role": "user", "content": "Weather?"}],
                                                "tools": [TOOL], "tool_choice": choice})
        assert response.status_code == 400 and "does not take tools" in response.text
    # a tool_choice that forces a call needs tools; a "tool" message needs a template that takes tools
    response = server.post(CHAT_PATH, json={"messages": [{"role": "user", "content": "hi"}],
                                            "tool_choice": "required"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    response = server.post(CHAT_PATH, json={"messages": [{"role": "tool", "content": "21 C",
                                                          "tool_call_id": "call_1"}]})
    assert response.status_code == 400 and "unknown chat role 'tool'" in response.text


def test_tool_choice_none_answers_without_tools(client):
    reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                           tools=[TOOL], tool_choice="none", max_tokens=4, temperature=0)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content


@pytest.fixture(scope="module")
def tool_client():
    for server in serving("--served-model-name", "x", "--chat-template", "chatml-tools"):
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_tool_calls_with_a_template_that_renders_tools(tool_client):
    """A forced call comes back as OpenAI tool_calls whose arguments follow the tool's schema; the
    call and the tool's answer then go back into the chat and the model answers in text."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = tool_client.chat.completions.create(
        model="x", messages=messages, tools=[TOOL], temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "21 C and sunny"}]
    answer = tool_client.chat.completions.create(model="x", messages=messages, tools=[TOOL],
                                                 tool_choice="none", temperature=0, max_tokens=16)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    streamed = tool_client.chat.completions.create(
        model="x", messages=messages[:1], tools=[TOOL], tool_choice="required", temperature=0,
        max_tokens=40, stream=True)
    chunks = list(streamed)
    calls = [c for chunk in chunks for delta in [chunk.choices[0].delta] if delta.tool_calls
             for c in delta.tool_calls]
    assert calls and calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_chat_template_that_is_not_there_stops_the_server_with_its_name(tmp_path):
    from kvreplay import LLM
    with pytest.raises(ValueError, match="neither a file nor a shipped template"):
        LLM(chat_template=str(tmp_path / "missing.jinja"))
    (tmp_path / "broken.jinja").write_text("{% for %}")
    with pytest.raises(ValueError, match="not a Jinja template"):
        LLM(chat_template=str(tmp_path / "broken.jinja"))
    with pytest.raises(ValueError, match="chat_template must be a non-empty string"):
        LLM(chat_template="")

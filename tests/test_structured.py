"""Structured output (engine/grammar.py) through LLM, and the tool-call helpers (server/tools.py):
valid JSON on the real model, a schema's required keys, constrained and free rows in one batch,
bad formats refused, grammar state dropped on abort, the mask kernel against its reference."""
from __future__ import annotations

import json

import pytest
import torch

from kvreplay import SamplingParams
from kvreplay.engine.grammar import Constraint, _pack_bits, grammar_of
from kvreplay.kernels import cpu_kernels
from kvreplay.sampling import apply_token_bitmask, check_response_format
from kvreplay.server.tools import ToolCallStream, parse_tool_calls, tool_response_format

JSON_OBJECT = {"type": "json_object"}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 40}}}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
SYSTEM = ('Reply only with a compact JSON object, such as {"title": "Dune", "year": 1965}. Keep every '
          'value under five words.')  # bench/structured_output.py's
QUESTIONS = ["Describe a cat in JSON.", "Describe a song in JSON.", "Describe a movie in JSON."]
FREE = [{"role": "user", "content": "What is the capital of France?"}]


def _chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_json_mode_returns_valid_json(llm32):
    outputs = llm32.chat([_chat(q) for q in QUESTIONS],
                         SamplingParams(max_tokens=96, temperature=0, response_format=JSON_OBJECT))
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text  # the grammar ended it
        assert isinstance(json.loads(completion.text), dict), completion.text


@pytest.mark.parametrize("max_tokens", [9, 14, 24])
def test_json_mode_closes_the_value_within_max_tokens(llm32, max_tokens):
    """The budget runs out mid-object: the last tokens close it instead of cutting it."""
    question = _chat("Describe a fictional city in JSON with ten keys.")
    free = llm32.chat(question, SamplingParams(max_tokens=max_tokens, temperature=0,
                                               response_format=JSON_OBJECT, ignore_eos=True))
    completion = free.outputs[0]
    assert len(completion.token_ids) <= max_tokens
    assert isinstance(json.loads(completion.text), dict), completion.text


def test_constraint_follows_strings_and_nesting():
    constraint = Constraint(matcher=None)
    constraint.feed(b'{"a": [1, {"b\\\\": "x"}')  # a key ending in an escaped backslash
    assert (constraint.depth, constraint.in_string, constraint.escaped) == (2, False, False)
    constraint.feed(b', "q\\')
    assert (constraint.in_string, constraint.escaped) == (True, True)
    constraint.feed(b'"{')  # an escaped quote, then a brace, both inside the string
    assert (constraint.depth, constraint.in_string, constraint.escaped) == (2, True, False)
    constraint.feed(b'"]')
    assert (constraint.depth, constraint.in_string) == (1, False)
    assert constraint.closing_cost() == 7


def test_closing_bitmask_layout():
    flags = torch.zeros(64, dtype=torch.bool)
    flags[[0, 31, 33]] = True
    words = _pack_bits(flags)
    assert words.tolist() == [1 - 2**31, 2]


def test_json_schema_keeps_required_keys_and_types(llm32):
    output = llm32.chat(_chat("Describe a fictional person in JSON."),
                        SamplingParams(max_tokens=64, temperature=0, response_format=PERSON_FORMAT))
    value = json.loads(output.outputs[0].text)
    assert set(PERSON["required"]) <= set(value)
    assert isinstance(value["age"], int) and isinstance(value["name"], str)


def test_constrained_and_free_rows_in_one_batch(llm32):
    """Each row gets what it asked for, and the free rows' greedy tokens are those of a batch
    that takes the LM head's argmax (no constrained row in it)."""
    free = SamplingParams(max_tokens=16, temperature=0)
    colors = [{"role": "user", "content": "Name three colors."}]
    alone = llm32.chat([FREE, colors], free)
    mixed = llm32.chat([FREE, _chat(QUESTIONS[0]), colors],
                       [free, SamplingParams(max_tokens=48, temperature=0, response_format=PERSON_FORMAT), free])
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert set(PERSON["required"]) <= set(json.loads(mixed[1].outputs[0].text))


def test_sampled_branches_each_keep_their_grammar(llm32):
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=7, n=3, response_format=JSON_OBJECT)
    output = llm32.chat(_chat(QUESTIONS[1]), params)
    for completion in output.outputs:
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict), completion.text
        else:  # a branch may run out of tokens; what it wrote is still a prefix of JSON
            assert completion.text.startswith("{"), completion.text


def test_abort_drops_the_grammar_state(llm32):
    engine = llm32.engine
    prompt = llm32.chat_prompt_ids(_chat(QUESTIONS[0]))
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=32, temperature=0,
                                                           response_format=JSON_OBJECT, n=2))
    seqs = engine.requests[request_id].seqs
    assert all(seq.grammar is not None for seq in seqs)
    assert seqs[0].grammar is not seqs[1].grammar  # one matcher per branch
    engine.step()
    engine.step()
    engine.abort_request(request_id)
    assert all(seq.grammar is None for seq in seqs)
    engine.check_integrity()


@pytest.mark.parametrize("response_format, message", [
    ("json", "must be an object"),
    ({"type": "xml"}, "response_format.type must be one of"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": True}}, "must be a JSON Schema object"),
])
def test_bad_response_formats_are_refused(response_format, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(response_format=response_format)


def test_text_format_is_free_text_and_beams_are_refused():
    assert check_response_format({"type": "text"}) is None
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(beam_width=2, response_format=JSON_OBJECT)


@pytest.mark.parametrize("schema, message", [
    ({"type": "foo"}, "Invalid type"),
    ({"type": "string", "pattern": "(("}, "regex parse error"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "does not exist"),
])
def test_schemas_that_cannot_be_enforced_name_the_field(schema, message):
    with pytest.raises(ValueError, match=message) as caught:
        grammar_of({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert "response_format.json_schema.schema" in str(caught.value)


def test_engine_refuses_a_bad_schema_before_queuing(llm32):
    with pytest.raises(ValueError, match="Invalid type"):
        llm32.generate("x", SamplingParams(response_format={
            "type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}))
    assert not llm32.engine.has_unfinished_requests()


def test_mask_kernel_matches_its_reference(monkeypatch):
    if cpu_kernels.layer_ops() is None:
        pytest.skip("the CPU layer ops do not build here")
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=generator)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, 32), dtype=torch.int32, generator=generator)
    bitmask[1] = -1   # all allowed
    bitmask[2] = 0    # none allowed
    bitmask[3, :10] = 0
    compiled = logits.clone()
    apply_token_bitmask(compiled, bitmask)
    monkeypatch.setattr(cpu_kernels, "layer_ops", lambda: None)
    reference = logits.clone()
    apply_token_bitmask(reference, bitmask)
    assert torch.equal(compiled, reference)
    assert torch.equal(compiled[1], logits[1]) and torch.isinf(compiled[2]).all()
    bit = (bitmask[0, 0] >> 5) & 1  # token 5 of row 0
    assert (compiled[0, 5] == logits[0, 5]) == bool(bit)


def test_llm_chat_refuses_tools_for_a_template_without_them(llm32):
    assert llm32.supports_tools is False  # SmolLM2's template renders no tools
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(ValueError, match="does not take tools"):
        llm32.chat(FREE, SamplingParams(max_tokens=2), tools=[tool])
    with pytest.raises(ValueError, match="unknown chat role 'tool'"):
        llm32.chat_prompt_ids([{"role": "tool", "content": "42"}])


NAMES = {"get_weather", "add"}


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ('Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
     '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>',
     "Let me check.", [("get_weather", {"city": "Oslo"}), ("add", {"a": 1})]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ('[{"name": "add", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
     None, [("add", {}), ("get_weather", {"city": "Rome"})]),
    ('{"name": "unknown", "arguments": {}}', '{"name": "unknown", "arguments": {}}', []),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', []),
    ("Paris is the capital.", "Paris is the capital.", []),
    ('{"a": 1}', '{"a": 1}', []),
])
def test_tool_calls_are_parsed(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, NAMES)
    assert got_content == content
    assert [(call.name, json.loads(call.arguments)) for call in got_calls] == calls
    for call in got_calls:
        openai_call = call.as_openai()
        assert openai_call["type"] == "function" and openai_call["id"].startswith("call_")


def test_tool_choice_becomes_a_call_schema():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
             {"type": "function", "function": {"name": "now"}}]
    assert tool_response_format(tools, "auto") is None and tool_response_format(tools, None) is None
    named = tool_response_format(tools, {"type": "function", "function": {"name": "add"}})
    schema = named["json_schema"]["schema"]
    assert schema["properties"]["name"] == {"const": "add"} and schema["required"] == ["name", "arguments"]
    assert len(tool_response_format(tools, "required")["json_schema"]["schema"]["anyOf"]) == 2
    with pytest.raises(ValueError, match="not among the tools"):
        tool_response_format(tools, {"type": "function", "function": {"name": "nope"}})


def test_streamed_tool_calls_are_held_until_they_parse():
    call = ToolCallStream({"get_weather"})
    pieces = [" ", '{"name": "get', '_weather", "arguments": {"city": ', '"Paris"}}']
    deltas = [call.delta(piece, finished=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    assert [delta for delta, _ in deltas[:-1]] == [{}, {}, {}]
    last, called = deltas[-1]
    assert called and last["content"] is None and last["tool_calls"][0]["index"] == 0
    assert json.loads(last["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    text = ToolCallStream({"get_weather"})  # plain text streams as it comes
    assert text.delta("The", False) == ({"content": "The"}, False)
    assert text.delta(" sun", True) == ({"content": " sun"}, False)
    unknown = ToolCallStream({"get_weather"})  # held, but no call of a known tool: content at the end
    assert unknown.delta("<tool_", False) == ({}, False)
    assert unknown.delta('call>{"name": "other"}</tool_call>', True) == (
        {"content": '<tool_call>{"name": "other"}</tool_call>'}, False)

"""Tool calling for /v1/chat/completions: which grammar `tool_choice` asks for, and the model's
text parsed into OpenAI `tool_calls`.

The tools are rendered into the prompt by the model's own chat template, so only templates that
read a `tools` variable can take them (`LLM.supports_tools`); for any other template a request
that asks for tool calls is refused with a 400. With `tool_choice="auto"` (the default) the model
writes its calls in the format its template taught it and `parse_tool_calls` reads the common
ones: Hermes / Qwen `<tool_call>{...}</tool_call>` blocks, or a reply that is a JSON call object
(or a list of them) as Llama 3.x writes. With `"required"` or a named function the reply is
constrained (engine/grammar.py) to a JSON call `{"name": ..., "arguments": {...}}`.
Streamed, a reply that starts like a call is held back and sent as `tool_calls` deltas when it
ends (`ToolCallStream`); any other reply streams as content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from kvreplay.engine.grammar import grammar_of

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it

    def as_openai(self) -> dict:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def calls_expected(tools: list[dict] | None, tool_choice) -> bool:
    """Whether the request lets the model call a tool (tools given, tool_choice not "none")."""
    return bool(tools) and tool_choice != "none"


def tool_response_format(tools: list[dict], tool_choice) -> dict | None:
    """The response_format that `tool_choice` imposes: None for "auto" (free text, parsed
    afterwards), a JSON call of any tool for "required", of the named one for
    {"type": "function", "function": {"name": ...}}. ValueError for a name not among the tools."""
    if tool_choice in (None, "auto"):
        return None
    by_name = {tool["function"]["name"]: tool["function"] for tool in tools}
    if tool_choice == "required":
        chosen = list(by_name.values())
    else:
        name = tool_choice["function"]["name"]
        if name not in by_name:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools "
                             f"({', '.join(by_name)})")
        chosen = [by_name[name]]
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": function["name"]},
                               "arguments": function.get("parameters") or {"type": "object"}}}
               for function in chosen]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    response_format = {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}
    grammar_of(response_format)  # a tool's parameters that cannot be enforced: ValueError
    return response_format


class ToolCallStream:
    """One streamed choice of a request with tools. Its text is held while it may be a call (its
    first characters are `<tool_call>`'s, `{` or `[`), else streamed as content as it comes; held
    text becomes `tool_calls` deltas at the end when it parses as calls, else content."""

    def __init__(self, names: set[str]):
        self.names = names
        self.text = ""
        self.holding: bool | None = None  # None: not decided yet

    def delta(self, text: str, finished: bool) -> tuple[dict, bool]:
        """The chunk's delta for new `text` (whether the reply ended here), and whether it sent
        tool calls."""
        self.text += text
        if self.holding is None:
            start = self.text.lstrip()
            if start:
                self.holding = start[0] in "{[" or "<tool_call>".startswith(start[:11])
            elif not finished:
                return {}, False
        if not self.holding:
            sent, self.text = self.text, ""
            return ({"content": sent} if sent else {}), False
        if not finished:
            return {}, False
        content, calls = parse_tool_calls(self.text, self.names)
        if not calls:
            return {"content": self.text}, False
        return {"content": content, "tool_calls": [{"index": i, **call.as_openai()}
                                                   for i, call in enumerate(calls)]}, True


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content left over, calls) from a reply. A call is a JSON object naming one of `names`
    with its arguments under "arguments" (or Llama's "parameters"); text that holds none is
    all content, with no calls."""
    tagged = _TAGGED.findall(text)
    if tagged:
        calls = [call for call in (_call(_load(block), names) for block in tagged) if call]
        if calls:
            content = text[:text.find("<tool_call>")].strip()
            return content or None, calls
        return text, []
    value = _load(text.strip())
    items = value if isinstance(value, list) else [value]
    calls = [_call(item, names) for item in items]
    if items and all(calls):
        return None, calls
    return text, []


def _load(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(value, names: set[str]) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some templates teach arguments as a JSON string
        parsed = _load(arguments)
        arguments = parsed if isinstance(parsed, dict) else None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))

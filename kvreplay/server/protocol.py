"""Request bodies of the OpenAI-compatible API, validated strictly, and their mapping onto
SamplingParams.

Bounds on list sizes (`n`, `stop`, prompts per request) keep one request from claiming unbounded
memory; the body size itself is capped by the server before any of this runs.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvreplay.engine.grammar import grammar_of
from kvreplay.sampling import MAX_LOGPROBS, SamplingParams, check_response_format

MAX_N = 16                 # completions per prompt
MAX_PROMPTS = 16           # prompts in one /v1/completions request
MAX_STOP_STRINGS = 4       # as OpenAI
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOOLS = 128            # as OpenAI

# Known OpenAI fields this engine cannot honour: refuse them instead of silently ignoring them.
_UNSUPPORTED = ("functions", "function_call", "logit_bias", "suffix", "audio", "prediction")

class ProtocolError(ValueError):
    """A request the API refuses; `param` names the offending field (OpenAI error shape)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields /v1/completions and /v1/chat/completions share."""
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None                       # extension (vLLM)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool = False                       # extension (vLLM)
    user: str | None = None
    response_format: dict | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop):
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if not all(0 < len(string) <= MAX_STOP_CHARS for string in strings):
            raise ValueError(f"a stop string has 1 to {MAX_STOP_CHARS} characters")
        return stop

    def check_supported(self) -> None:
        for name in _UNSUPPORTED:
            if (self.model_extra or {}).get(name):
                raise ProtocolError(f"'{name}' is not supported by this server", name)
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise ProtocolError(f"'{name}' is not supported; leave it unset or 0", name)
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("'stream_options' is only allowed with stream=true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def checked_response_format(self) -> dict | None:
        """`response_format` checked for shape and its schema compiled once (ProtocolError, a
        400 naming the field, before the request reaches the engine)."""
        try:
            response_format = check_response_format(self.response_format)
            if response_format is not None:
                grammar_of(response_format)
        except ValueError as exc:
            raise ProtocolError(str(exc), "response_format") from None
        return response_format

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        response_format: dict | None = None) -> SamplingParams:
        """Raises ValueError (a 400) for values SamplingParams refuses."""
        self.check_supported()
        response_format = response_format or self.checked_response_format()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids or [], n=self.n,
            logprobs=logprobs, ignore_eos=self.ignore_eos, response_format=response_format)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict] | None = None           # an assistant's earlier calls
    tool_call_id: str | None = None                # the call a "tool" message answers

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # the chat template knows "system", not OpenAI's newer "developer"
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_list(self) -> list[dict] | None:
        """The tools as the chat template takes them (OpenAI's shape), or None when the request
        lets the model call none (no tools, or tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
                raise ProtocolError("tool_choice asks for a tool call but 'tools' is empty", "tool_choice")
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def to_sampling_params(self, response_format: dict | None = None) -> SamplingParams:
        """`response_format`: what tool_choice imposes (server/tools.py), instead of the body's."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("'top_logprobs' needs logprobs=true", "top_logprobs")
        if response_format is not None and self.response_format is not None:
            raise ProtocolError("'response_format' cannot be combined with a tool_choice that "
                                "forces a call", "response_format")
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                                    response_format)

    def choice_dump(self):
        """tool_choice as server/tools.py reads it: a string, a dict, or None."""
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    def conversation(self) -> list[dict[str, str]]:
        return [message.as_template_message() for message in self.messages]


Prompt = str | list[int]


class CompletionRequest(_GenerationRequest):
    prompt: (str | list[int]
             | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: int | None = 16                    # the OpenAI default for this endpoint
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _bounded_prompts(cls, prompt):
        # before the union's own checks, whose message for a long list names the wrong member
        if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and isinstance(prompt[0], (str, list)):
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return prompt

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise ProtocolError("'echo' is not supported", "echo")
        if self.best_of is not None and self.best_of != self.n:
            raise ProtocolError("'best_of' must equal n (or be left unset)", "best_of")
        return self.sampling_params(self.max_tokens, self.logprobs)

    def prompts(self) -> list[Prompt]:
        """One prompt (a string or token ids) per engine request."""
        prompt = self.prompt
        # [] is an empty token list, which the engine refuses with a clear message
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

"""POST /v1/chat/completions and /v1/completions, streamed (SSE) or not.

Both endpoints share one path: parse and validate -> admit (`AsyncEngine.submit`) -> either
collect the finished outputs, or stream a chunk per engine step. Every way out closes the
Generation, so a client that leaves aborts its requests and frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvreplay.outputs import CompletionOutput, RequestOutput
from kvreplay.server.state import ApiError, ServerState
from kvreplay.server.generation import (EngineUnavailableError, Generation, PromptTooLongError,
                                        QueueFullError)
from kvreplay.server.formatting import ChoiceStream, error_body, finish_fields, usage
from kvreplay.server.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from kvreplay.server.tools import ToolCallStream, parse_tool_calls, tool_response_format

router = APIRouter()
RETRY_AFTER_S = 1  # a full queue's Retry-After: sequences finish every engine step


class _ChatShape:
    """How /v1/chat/completions spells choices."""
    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, state: ServerState, num_top: int | None, tools: list[dict] | None = None):
        self.formatter, self.num_top = state.formatter, num_top
        self.tool_names = {tool["function"]["name"] for tool in tools or []}
        self.tool_streams: dict[int, ToolCallStream] = {}  # streamed choices, by index

    def choice(self, index: int, completion: CompletionOutput) -> dict:
        logprobs = None
        if self.num_top is not None:
            logprobs = self.formatter.chat_logprobs(completion.token_ids, completion.logprobs,
                                                    self.num_top)
        message = {"role": "assistant", "content": completion.text}
        finish = finish_fields(completion.finish_reason)
        if self.tool_names:
            content, calls = parse_tool_calls(completion.text, self.tool_names)
            if calls:
                message = {"role": "assistant", "content": content,
                           "tool_calls": [call.as_openai() for call in calls]}
                if completion.finish_reason == "stop":
                    finish = {"finish_reason": "tool_calls"}
        return {"index": index, "message": message, "logprobs": logprobs, **finish}

    def opening_choice(self, index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def chunk_choice(self, index, text, token_ids, entries, finish_reason, stream: ChoiceStream) -> dict:
        logprobs = None
        if self.num_top is not None:
            logprobs = self.formatter.chat_logprobs(token_ids, entries, self.num_top)
        delta, finish = ({"content": text} if text else {}), finish_fields(finish_reason)
        if self.tool_names:
            held = self.tool_streams.setdefault(index, ToolCallStream(self.tool_names))
            delta, called = held.delta(text, finish_reason is not None)
            if called and finish_reason == "stop":
                finish = {"finish_reason": "tool_calls"}
        return {"index": index, "delta": delta, "logprobs": logprobs, **finish}


class _CompletionShape(_ChatShape):
    """How /v1/completions spells choices (the legacy logprobs shape)."""
    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def choice(self, index: int, completion: CompletionOutput) -> dict:
        logprobs = None
        if self.num_top is not None:
            logprobs = self.formatter.completion_logprobs(completion.token_ids, completion.logprobs,
                                                          self.num_top)
        return {"index": index, "text": completion.text, "logprobs": logprobs,
                **finish_fields(completion.finish_reason)}

    def opening_choice(self, index: int) -> dict | None:
        return None

    def chunk_choice(self, index, text, token_ids, entries, finish_reason, stream: ChoiceStream) -> dict:
        logprobs = None
        if self.num_top is not None:
            logprobs = self.formatter.completion_logprobs(token_ids, entries, self.num_top,
                                                          stream.num_logprob_chars)
            stream.num_logprob_chars += sum(len(token) for token in logprobs["tokens"])
        return {"index": index, "text": text, "logprobs": logprobs, **finish_fields(finish_reason)}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await _handle(request, ChatCompletionRequest, _ChatShape, chat=True)


@router.post("/v1/completions")
async def completions(request: Request):
    return await _handle(request, CompletionRequest, _CompletionShape, chat=False)


async def _handle(request: Request, model: type[pydantic.BaseModel], shape_class, chat: bool):
    state: ServerState = request.app.state.server
    body = await parse_body(request, model, state.config.max_request_bytes)
    state.check_model(body.model)
    tools = _tools(state, body) if chat else None
    params = _sampling_params(body, tools)
    prompts = [body.conversation()] if chat else body.prompts()
    shape = shape_class(state, params.logprobs, tools) if chat else shape_class(state, params.logprobs)
    return await _serve(request, state, body, prompts, params, shape, chat, tools)


def _tools(state: ServerState, body: ChatCompletionRequest) -> list[dict] | None:
    """The tools the model may call (None: none), refused for a template that cannot take them."""
    try:
        tools = body.tool_list()
    except ProtocolError as exc:
        raise ApiError(400, str(exc), exc.param) from None
    if tools is None:
        return None
    if not state.engine.llm.supports_tools:
        raise ApiError(400, "this model's chat template does not take tools, so tool calling is "
                            "not available with it: leave out 'tools' (or set tool_choice to "
                            "'none'), or serve a model whose template renders them", "tools")
    return tools


async def parse_body(request: Request, model: type[pydantic.BaseModel], max_bytes: int):
    """The request's JSON body as `model`: 413 past `max_bytes` (read in chunks, never whole),
    400 naming the first invalid field."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body has {declared} bytes; the limit is {max_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    try:
        return model.model_validate_json(b"".join(chunks))
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "body"
        # a validator's own message, without pydantic's "Value error, " before it
        cause = error.get("ctx", {}).get("error") if error["type"] == "value_error" else None
        message = str(cause) if cause is not None else error["msg"]
        raise ApiError(400, f"{where}: {message}", where if error["loc"] else None) from None


def _sampling_params(body, tools: list[dict] | None = None):
    try:
        if not tools:
            return body.to_sampling_params()
        try:  # "required" or a named function: the reply is constrained to a JSON call
            forced = tool_response_format(tools, body.choice_dump())
        except ValueError as exc:
            raise ProtocolError(str(exc), "tool_choice") from None
        return body.to_sampling_params(forced)
    except ProtocolError as exc:
        raise ApiError(400, str(exc), exc.param) from None
    except (ValueError, TypeError) as exc:
        raise ApiError(400, str(exc)) from None


async def _serve(request: Request, state: ServerState, body, prompts, params, shape, chat: bool,
                 tools: list[dict] | None = None):
    arrival = time.monotonic()
    try:
        generation = await state.engine.submit(prompts, params, stream=body.stream, chat=chat,
                                               tools=tools)
    except QueueFullError as exc:
        raise ApiError(429, str(exc), code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except EngineUnavailableError as exc:
        raise ApiError(503, str(exc)) from None
    except PromptTooLongError as exc:
        raise ApiError(400, str(exc), "messages" if chat else "prompt",
                       "context_length_exceeded") from None
    except (ValueError, TypeError) as exc:
        raise ApiError(400, str(exc)) from None
    header = {"id": f"{shape.prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
              "model": state.config.served_model_name}
    if body.stream:
        events = _events(state, generation, shape, header, params.n, params.stop,
                         body.include_usage, arrival)
        return _EventStream(events, generation)
    try:
        outputs = await _collect_unless_disconnected(request, generation)
    except EngineUnavailableError as exc:
        raise ApiError(503, str(exc)) from None
    finally:
        generation.close()
    if outputs is None:  # the client is gone (its requests are aborted): nobody reads this,
        return Response(status_code=499)  # but kvreplay_requests_total counts it, as nginx would
    state.metrics.request_latency.observe(time.monotonic() - arrival)
    choices = [shape.choice(prompt_index * params.n + completion.index, completion)
               for prompt_index, output in enumerate(outputs) for completion in output.outputs]
    return JSONResponse({**header, "object": shape.object, "choices": choices,
                         "usage": usage(outputs)})


async def _collect(generation: Generation) -> list[RequestOutput]:
    finished: dict[int, RequestOutput] = {}
    async for prompt_index, output in generation:
        if output.finished:
            finished[prompt_index] = output
    return [finished[i] for i in range(len(finished))]


async def _collect_unless_disconnected(request: Request, generation: Generation):
    """The finished outputs, or None if the client disconnected first."""
    collect = asyncio.ensure_future(_collect(generation))
    disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collect, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collect, disconnected):
            task.cancel()
        # a cancelled task is not done until it has run once more: wait for both to end
        await asyncio.gather(collect, disconnected, return_exceptions=True)
    return None if collect.cancelled() else collect.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the client going away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """An SSE response that closes its Generation however the stream ends (finished, client
    gone before or during the stream, server shutdown)."""

    def __init__(self, events, generation: Generation):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generation = generation

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _events(state: ServerState, generation: Generation, shape, header: dict, n: int,
                  stop: list[str], include_usage: bool, arrival: float):
    chunk = {**header, "object": shape.chunk_object}
    streams: dict[int, ChoiceStream] = {}
    finals: dict[int, RequestOutput] = {}
    first_token_at = last_token_at = None
    try:
        opening = [shape.opening_choice(i) for i in range(len(generation.request_ids) * n)]
        if opening[0] is not None:
            yield _sse({**chunk, "choices": opening})
        async for prompt_index, output in generation:
            choices = []
            for completion in output.outputs:
                index = prompt_index * n + completion.index
                stream = streams.setdefault(index, ChoiceStream(stop=tuple(stop)))
                if stream.finished:
                    continue
                text = stream.text_delta(completion)
                token_ids, entries = stream.new_tokens(completion)
                if token_ids:
                    last_token_at = time.monotonic()
                    first_token_at = first_token_at or last_token_at
                stream.finished = completion.finish_reason is not None
                if text or token_ids or stream.finished:  # a chunk per step: tokens stream as made
                    choices.append(shape.chunk_choice(index, text, token_ids, entries,
                                                      completion.finish_reason, stream))
            if output.finished:
                finals[prompt_index] = output
            if choices:
                yield _sse({**chunk, "choices": choices})
        if include_usage:
            yield _sse({**chunk, "choices": [], "usage": usage([finals[i] for i in sorted(finals)])})
        _observe_latency(state, streams, arrival, first_token_at, last_token_at)
    except EngineUnavailableError as exc:
        yield _sse(error_body(str(exc), "service_unavailable_error"))
    yield "data: [DONE]\n\n"


def _observe_latency(state: ServerState, streams: dict[int, ChoiceStream], arrival: float,
                     first_token_at: float | None, last_token_at: float | None) -> None:
    metrics = state.metrics
    if first_token_at is None:
        return
    metrics.time_to_first_token.observe(first_token_at - arrival)
    num_steps = max(stream.num_sent_tokens for stream in streams.values())
    if num_steps > 1:  # choices decode side by side, so the slowest choice counts the steps
        metrics.time_per_output_token.observe((last_token_at - first_token_at) / (num_steps - 1))
    metrics.request_latency.observe(last_token_at - arrival)

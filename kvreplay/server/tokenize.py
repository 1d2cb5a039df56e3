"""POST /v1/tokenize and /v1/detokenize, in vLLM's request and response shapes (also at vLLM's
paths, /tokenize and /detokenize).

Tokenize takes a `prompt` (a string) or chat `messages` and returns the ids the generation
endpoints would queue for it, with their `count` and the context (`max_model_len`), so a client
can check a prompt's length before sending it. Detokenize takes `tokens` and returns their text
as `prompt`. Both run on the prompt preparer's thread (server/prompts.py), never the engine's,
and refuse a text over max_prompt_bytes before tokenizing it.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvreplay.server.completions import parse_body
from kvreplay.server.generation import PromptTooLongError
from kvreplay.server.protocol import ChatMessage
from kvreplay.server.state import ApiError, ServerState

router = APIRouter(tags=["tokenizer"])


class TokenizeRequest(BaseModel):
    """A text (`prompt`) or a conversation (`messages`), not both."""
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # None: True for a prompt (as /v1/completions tokenizes it), False for messages (the chat
    # template writes the special tokens itself), as vLLM defaults them
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True  # messages only: end with the assistant's header

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' (a string) or 'messages' (a chat), not both "
                             "or neither")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/v1/tokenize", response_model=TokenizeResponse)
@router.post("/tokenize", response_model=TokenizeResponse, include_in_schema=False)
async def tokenize(request: Request):
    """Token ids of a prompt, or of chat messages rendered by the model's chat template (body:
    `prompt` or `messages`; `add_special_tokens`, `add_generation_prompt`)."""
    state: ServerState = request.app.state.server
    body = await parse_body(request, TokenizeRequest, state.config.max_request_bytes)
    state.check_model(body.model)
    chat = body.messages is not None
    prompt = [message.as_template_message() for message in body.messages] if chat else body.prompt
    add_special_tokens = not chat if body.add_special_tokens is None else body.add_special_tokens
    preparer = state.engine.preparer
    try:
        preparer.check_sizes([prompt], chat)
        token_ids = await preparer.tokenize(prompt, add_special_tokens, body.add_generation_prompt)
    except PromptTooLongError as exc:
        raise ApiError(400, str(exc), "messages" if chat else "prompt", "context_length_exceeded") from None
    except (ValueError, TypeError) as exc:
        raise ApiError(400, str(exc), "messages" if chat else "prompt") from None
    return TokenizeResponse(count=len(token_ids), max_model_len=preparer.max_model_len, tokens=token_ids)


@router.post("/v1/detokenize", response_model=DetokenizeResponse)
@router.post("/detokenize", response_model=DetokenizeResponse, include_in_schema=False)
async def detokenize(request: Request):
    """The text of token ids (body: `tokens`), special tokens included."""
    state: ServerState = request.app.state.server
    body = await parse_body(request, DetokenizeRequest, state.config.max_request_bytes)
    state.check_model(body.model)
    vocab_size = state.engine.engine.model_config.vocab_size
    bad = [token for token in body.tokens if not 0 <= token < vocab_size]
    if bad:
        raise ApiError(400, f"token ids must be in [0, {vocab_size}), got {bad[:5]}", "tokens")
    return DetokenizeResponse(prompt=await state.engine.preparer.detokenize(body.tokens))

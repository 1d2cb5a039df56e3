"""What a submission to the engine loop gets back, and how the loop refuses one."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from kvreplay.outputs import RequestOutput


class QueueFullError(RuntimeError):
    """More sequences are queued than the server admits; the client should retry later (429)."""


class EngineUnavailableError(RuntimeError):
    """The engine is shutting down or has failed (503)."""


class PromptTooLongError(ValueError):
    """A prompt longer than the context, found by its bytes or its tokens (400,
    code context_length_exceeded)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """What the metrics read, published by the engine thread after each step."""
    num_blocks: int = 0
    num_used_blocks: int = 0   # of which num_index_blocks stand for the key index's bytes
    num_index_blocks: int = 0  # pool blocks reserved for the key index's and cold tier's bytes
    block_bytes: int = 1
    index_bytes: int = 0       # key index (dropped blocks' int4 keys and summaries)
    cold_bytes: int = 0        # cold tier (quantized blocks)
    num_running: int = 0
    num_waiting: int = 0
    counters: dict = field(default_factory=dict)        # EngineCounters fields
    request_stats: dict = field(default_factory=dict)   # RequestStats fields summed over finished seqs
    tier: dict = field(default_factory=dict)            # the session tier's SessionTier.snapshot(), if on
    blocks_by_group: dict = field(default_factory=dict)  # layer group -> {"used", "cached"} blocks


class Generation:
    """The outputs of one submission (one engine request per prompt) as the engine makes them.

    Iterate it for `(prompt_index, RequestOutput)` until every request has finished; always
    `close()` it (also when the client went away): that frees its admission slots and aborts
    whatever is unfinished, which frees its KV blocks.
    """

    def __init__(self, request_ids: list[str], num_seqs: int,
                 release: Callable[[int, list[str]], None]):
        self._release = release  # (admitted sequences, unfinished request ids) -> None
        self.request_ids = request_ids
        self._index = {request_id: i for i, request_id in enumerate(request_ids)}
        self._unfinished = set(request_ids)
        self._num_seqs = num_seqs
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = False

    def push(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return self._index[item.request_id], item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release(self._num_seqs, sorted(self._unfinished))

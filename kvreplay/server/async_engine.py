"""One engine loop for every client.

`LLMEngine` is not thread-safe, so one dedicated thread owns it. The event loop never touches the
engine: it posts jobs (add these prompts, abort that request, run this check) to the thread's
inbox, and the thread hands outputs back on each submission's asyncio queue:

    HTTP handlers ── submit() / close() / call() ──▶ inbox (jobs) ──▶ engine thread: jobs, step()
          ▲                                                                  │
          └──── Generation (asyncio.Queue) ◀──── loop.call_soon_threadsafe ───┘

Jobs run between steps, so every request added in one step joins the next one: concurrent
clients share the continuous batch. Prompts reach the engine thread as token ids: `submit`
has them rendered and tokenized on a thread of their own first (prompts.py), so a long prompt
never stalls the step loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from kvreplay.api import LLM
from kvreplay.engine import step_log
from kvreplay.engine.kv_map import kv_state
from kvreplay.outputs import RequestOutput
from kvreplay.sampling import SamplingParams
from kvreplay.server import allocator
from kvreplay.server.generation import (EngineSnapshot, EngineUnavailableError, Generation,
                                        QueueFullError)
from kvreplay.server.prompts import PreparedPrompt, PromptPreparer

logger = logging.getLogger(__name__)
TRIM_EVERY_STEPS = 256  # engine steps between returns of free heap pages (server/allocator.py)


@dataclass
class _Job:
    fn: Callable[[], object]
    done: Callable[[object, BaseException | None], None] | None = None


class AsyncEngine:
    """Runs `llm.engine` on its own thread and multiplexes clients onto it.

    Args:
        llm: the loaded model; its engine and tokenizer are used only from the engine thread
            (prompts are tokenized with a private copy of the tokenizer).
        max_queued_seqs: sequences (prompts x n) admitted and unfinished at most; a submission
            beyond it fails at once with QueueFullError.
        max_seqs_per_request: sequences one submission may ask for (at most max_queued_seqs
            count); more is a ValueError, so that one request cannot fill the queue.
        max_prompt_bytes: a prompt over this many bytes is refused before tokenizing
            (PromptPreparer; None: derived from the context length).
        tokenize_nice: added to the tokenizing thread's OS niceness (PromptPreparer).
    """

    def __init__(self, llm: LLM, max_queued_seqs: int = 256, max_seqs_per_request: int = 64,
                 max_prompt_bytes: int | None = None, tokenize_nice: int = 0):
        self.llm = llm
        self.engine = llm.engine
        self.max_queued_seqs = max_queued_seqs
        self.max_seqs_per_request = min(max_seqs_per_request, max_queued_seqs)
        self.preparer = PromptPreparer(llm, max_prompt_bytes, tokenize_nice)
        self.num_queued_seqs = 0           # event-loop thread only
        self.accepting = True
        self.failure: BaseException | None = None
        self.snapshot = EngineSnapshot()
        self._inbox: queue.Queue[_Job] = queue.Queue()
        self._inbox_lock = threading.Lock()  # orders "post a job" against "the loop has ended"
        self._ended = False
        self._stop_requested = False
        self._cut = False  # every request was aborted for shutdown: add no more (engine thread)
        self._sinks: dict[str, Callable[[object], None]] = {}  # engine thread only
        self._stats_totals: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="kvreplay-engine", daemon=True)
        self._publish()

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        self._thread.start()

    @property
    def drained(self) -> bool:
        """Refusing new work, and every admitted submission has been closed (its client served)."""
        return not self.accepting and self.num_queued_seqs == 0

    def drain(self, timeout_s: float) -> None:
        """Refuse new work now; abort whatever is still running after `timeout_s` seconds, so
        its clients get a final chunk (finish_reason "length", stop_reason "shutdown") instead
        of a cut connection. Safe to call from a signal handler."""
        self.accepting = False
        timer = threading.Timer(timeout_s, self._post, args=(_Job(self._abort_all),))
        timer.daemon = True
        timer.start()

    async def shutdown(self) -> None:
        """Refuse new work, abort what is still in flight, and wait for the engine thread."""
        self.accepting = False
        self._post(_Job(self._request_stop))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        tier_io = self.engine.kv.tier_io
        if tier_io is not None:  # the session tier's writes in flight reach their files
            await asyncio.get_running_loop().run_in_executor(None, tier_io.tier.close)

    async def call(self, fn: Callable[[], object]):
        """Run `fn()` on the engine thread between steps and return its result (or raise)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(result, error):
            _call_soon(loop, _settle, future, result, error)
        self._post(_Job(fn, done))
        return await future

    async def kv_state(self) -> dict:
        """The KV map (engine/kv_map.py), drawn on the engine thread between steps: the console's
        picture is never a half-done step."""
        return await self.call(lambda: kv_state(self.engine, time.time(), self._stats_totals))

    async def submit(self, prompts: list, params: SamplingParams, *, stream: bool,
                     chat: bool, tools: list[dict] | None = None) -> Generation:
        """Queue one engine request per prompt (a string, token ids, or with chat=True a
        conversation, rendered with `tools` when given). Raises ValueError/TypeError for bad input (PromptTooLongError for a
        prompt longer than the context), QueueFullError when full, EngineUnavailableError
        while shutting down."""
        if self.failure is not None or not self.accepting:
            raise EngineUnavailableError(self._unavailable_reason())
        num_seqs = len(prompts) * params.n
        if num_seqs > self.max_seqs_per_request:
            raise ValueError(f"this request asks for {num_seqs} sequences ({len(prompts)} "
                             f"prompt(s) x n={params.n}); the server runs at most "
                             f"{self.max_seqs_per_request} per request: send fewer prompts or "
                             f"a smaller n")
        if params.stop_token_ids:
            params.check_token_ids(self.engine.model_config.vocab_size)
        self.preparer.check_sizes(prompts, chat)  # cheap; before taking slots
        if self.num_queued_seqs + num_seqs > self.max_queued_seqs:
            raise QueueFullError(f"the server queue is full ({self.num_queued_seqs} of "
                                 f"{self.max_queued_seqs} sequences): retry later")
        self.num_queued_seqs += num_seqs
        prefix = uuid.uuid4().hex[:16]
        generation = Generation([f"{prefix}-{i}" for i in range(len(prompts))], num_seqs,
                                self._release)
        loop = asyncio.get_running_loop()

        def sink(item):
            _call_soon(loop, generation.push, item)
        try:  # the slots stay taken while the prompts are tokenized: that queue is bounded too
            prepared = await self.preparer.prepare(prompts, chat, tools)
            await self.call(lambda: self._add_all(generation.request_ids, prepared, params,
                                                  stream, sink))
        except BaseException:
            generation.close()
            raise
        return generation

    def _release(self, num_seqs: int, unfinished: list[str]) -> None:
        self.num_queued_seqs -= num_seqs
        if unfinished:
            self._post(_Job(lambda: [self._abort(request_id) for request_id in unfinished]))

    def _post(self, job: _Job) -> None:
        with self._inbox_lock:
            if not self._ended:
                self._inbox.put(job)
                return
        if job.done is not None:
            job.done(None, EngineUnavailableError("the engine loop has stopped"))

    # ------------------------------------------------------------------ engine thread
    def _add_all(self, request_ids: list[str], prepared: list[PreparedPrompt],
                 params: SamplingParams, stream: bool, sink) -> None:
        if self._cut:  # admitted before the drain, tokenized after its deadline
            raise EngineUnavailableError(self._unavailable_reason())
        added = []
        try:
            for request_id, prompt in zip(request_ids, prepared):
                num_tokens = len(prompt.token_ids)
                self.engine.add_request(prompt.token_ids, self._default_max_tokens(params, num_tokens),
                                        request_id=request_id, stream=stream,
                                        protected_tokens=prompt.protected_tokens,
                                        hot_from=prompt.hot_from)
                self._sinks[request_id] = sink
                added.append(request_id)
        except BaseException:
            for request_id in added:  # all prompts of a request or none
                self._abort(request_id)
            raise

    def _default_max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """Without max_tokens a request may fill what is left of the context or the KV pool,
        whichever is smaller (the engine refuses a request that cannot fit the pool)."""
        if params.max_tokens is not None:
            return params
        room = min(self.engine.max_model_len, self.engine.kv.capacity_tokens) - num_prompt_tokens
        return dataclasses.replace(params, max_tokens=room) if room >= 1 else params

    def _abort(self, request_id: str) -> RequestOutput | None:
        self._sinks.pop(request_id, None)
        output = self.engine.abort_request(request_id)
        self._count_stats(output)
        return output

    def _count_stats(self, output: RequestOutput | None) -> None:
        """Add an ended request's KV counters to the totals /metrics shows."""
        for completion in output.outputs if output is not None else ():
            for name, value in completion.stats.as_dict().items():
                self._stats_totals[name] = self._stats_totals.get(name, 0) + value

    def _request_stop(self) -> None:
        self._stop_requested = True

    def _abort_all(self) -> None:
        """Abort every request that has a client (shutdown); each client gets its aborted output,
        or an error when the engine has failed and cannot be trusted to produce one."""
        self._cut = True
        fallback = EngineUnavailableError(self._unavailable_reason())
        for request_id, sink in list(self._sinks.items()):
            output = self._abort(request_id) if self.failure is None else None
            sink(output if output is not None else fallback)
        self._sinks.clear()
        self._publish()

    def _unavailable_reason(self) -> str:
        return ("the server is shutting down" if self.failure is None
                else f"the engine failed: {self.failure}")

    def _run(self) -> None:
        steps = 0
        try:
            while not self._stop_requested:
                self._run_jobs(wait=not self.engine.has_unfinished_requests())
                if self._stop_requested or not self.engine.has_unfinished_requests():
                    continue
                self._deliver(step_log.step(self.engine))
                steps += 1
                if steps % TRIM_EVERY_STEPS == 0:
                    allocator.release_free_memory()
        except BaseException as exc:  # a bug, not user input: fail loudly, keep the process up
            logger.exception("the engine loop failed; the server now answers 503")
            self.failure = exc
        finally:
            self._end_loop()

    def _run_jobs(self, wait: bool) -> None:
        try:
            job = self._inbox.get() if wait else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                result, error = job.fn(), None
            except Exception as exc:
                result, error = None, exc
                if job.done is None:
                    logger.exception("engine job failed")
            if job.done is not None:
                job.done(result, error)
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                self._publish()  # adds and aborts change what /metrics shows
                return

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        deliveries = []
        for output in outputs:
            if output.finished:
                sink = self._sinks.pop(output.request_id, None)
                self._count_stats(output)
            else:
                sink = self._sinks.get(output.request_id)
            if sink is not None:
                deliveries.append((sink, output))
        self._publish()  # before delivering, so a client that saw its end sees it in /metrics
        for sink, output in deliveries:
            sink(output)

    def _end_loop(self) -> None:
        with self._inbox_lock:
            self._ended = True
        error = EngineUnavailableError(self._unavailable_reason())
        while True:  # jobs posted before the loop ended still get an answer
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if job.done is not None:
                job.done(None, error)
        self._abort_all()

    def _publish(self) -> None:
        engine = self.engine
        self.snapshot = EngineSnapshot(
            num_blocks=engine.kv.num_blocks, num_used_blocks=engine.kv.num_used_blocks,
            num_running=engine.num_running, num_waiting=engine.num_waiting,
            num_index_blocks=engine.kv.num_reserved_blocks, block_bytes=engine.kv.block_bytes,
            index_bytes=engine.kv.index_bytes, cold_bytes=engine.kv.cold_bytes,
            counters=dataclasses.asdict(engine.counters), request_stats=dict(self._stats_totals),
            tier=engine.kv.tier_io.tier.snapshot() if engine.kv.tier_io is not None else {},
            blocks_by_group=engine.kv.local.blocks_by_group())


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Hand a result to the event loop; a loop that has closed (shutdown) has no one to tell."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled (its client went away)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

"""The step loop: schedule, run the model, sample, detokenize, finish, report."""
from __future__ import annotations

import logging
import random
import time
from functools import partial

import torch

from kvreplay.config import AUTO, EngineConfig
from kvreplay.engine.beam import BeamGroup, step_beams
from kvreplay.engine.calibration import replay_knobs
from kvreplay.engine.chat_template import ChatTemplate
from kvreplay.engine.counters import EngineCounters
from kvreplay.engine.grammar import Grammars
from kvreplay.engine.kv_events import KVEventPublisher
from kvreplay.engine.layered_pass import layered_work_bytes
from kvreplay.engine.model_runner import ModelRunner, StepResult
from kvreplay.engine.request import Request, check_request
from kvreplay.engine.scheduler import ScheduledBatch, Scheduler
from kvreplay.engine.sequence import Sequence, SequenceStatus
from kvreplay.engine.sessions import KeptSessions
from kvreplay.engine.tier_loads import attach_tier
from kvreplay.engine.model_setup import build_kv_manager, load_engine_model
from kvreplay.kv.policy import without_detector
from kvreplay.outputs import RequestOutput
from kvreplay.sampling import SamplingParams, rows_logprobs, sample

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        loaded = load_engine_model(config)  # engine/model_setup.py: the model's class, its checks
        self.model, self.tokenizer, self.model_source = loaded.model, loaded.tokenizer, loaded.source
        self.model_config, self.max_model_len = self.model.config, loaded.max_model_len
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = set() if eos is None else {int(eos)}

        dtype_bytes = torch.finfo(config.torch_dtype).bits // 8
        self.kv_bytes_per_token = self.model_config.kv_bytes_per_token(dtype_bytes)
        cfg = self.model_config
        named = config.need_layer_set  # a set, None (all) or "auto"
        if isinstance(named, frozenset) and named and max(named) >= cfg.num_layers:
            raise ValueError(f"need_layers={config.need_layers!r} names a layer past the model's "
                             f"{cfg.num_layers} (0-{cfg.num_layers - 1})")
        need_layers, heavy_tokens, replay_threshold, self.calibration = replay_knobs(
            config, self.model, self.tokenizer, self.model_source)
        policy = without_detector(config.kv_policy) if need_layers == frozenset() else config.kv_policy
        self.kv = build_kv_manager(config, cfg, need_layers or None)  # engine/model_setup.py: sized to the budget
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.watermark_levels, config.pause_mode, block_bytes=self.kv.block_bytes,
                                   policy=policy, window_tokens=config.window_tokens,
                                   trim=config.trim, approx_prefill=config.approx_prefill,
                                   heavy_tokens=heavy_tokens, trim_order=config.trim_order,
                                   resident_ratio=config.resident_ratio, num_layers=cfg.num_layers,
                                   layered_work=partial(layered_work_bytes, cfg, config.block_size, config.torch_dtype,
                                                        self.kv_bytes_per_token) if config.layered_prefill else None,
                                   replay_threshold=replay_threshold, replay_hold=config.replay_hold)
        self.runner = ModelRunner(self.model, self.kv, detect_need=policy.replays_on_need,
                                  need_layers=need_layers,
                                  need_top_blocks=config.need_top_blocks,
                                  sparse_budget=config.sparse_budget, dense_layers=config.dense_layers,
                                  observe_importance=config.kv_policy.drops_middle or config.kv_policy.demotes,
                                  restart_importance=policy.replays,
                                  layered_chunk_tokens=config.max_num_batched_tokens,
                                  select_hot=self.scheduler.reclaim.attention_selection
                                  if config.kv_policy.selects_per_step else None,
                                  use_triton=config.use_triton)
        self.kv.key_index.triton = self.runner.triton  # the need detector's bound and block scores
        self.scheduler.reclaim.importance_pool = int(policy.replays) if config.importance_pool == AUTO \
            else config.importance_pool
        self.tier_loader = attach_tier(self)  # the session tier, when kv_tier_* ask for one
        self.grammars = Grammars(self.tokenizer, cfg.vocab_size, self.eos_token_ids)
        self.chat_template = ChatTemplate(self.tokenizer, cfg.vocab_size, config.hot_turns)
        self.requests: dict[str, Request] = {}
        self.sessions = KeptSessions(self.kv.free)  # finished requests kept for their next round
        self.counters = EngineCounters()
        self._rng = random.Random(config.seed)
        self._next_id = 0
        self.kv_events = KVEventPublisher(config.kv_events, config.block_size) if config.kv_events else None

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = False,
                    protected_tokens: int = 0, hot_from: int | None = None, keep: bool = False,
                    continues: str | None = None) -> str:
        """Queue a prompt. Raises ValueError/TypeError for input the engine cannot serve.

        `protected_tokens`: the first tokens of the prompt (e.g. the system message) are a
        protected zone: pinned, kept through a pause; so are the first `sink_tokens`.
        `hot_from`: a prompt position from which the cold presets keep every block hot (a
        chat's last rounds); None for none. `keep`: when the request finishes, park its KV as
        its policy left it (`release` frees it); `continues`: the id of such a request whose
        tokens this prompt extends: only the new tokens are prefilled (engine/sessions.py)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = self.chat_template.tokenize(prompt)
        max_tokens = check_request(token_ids, params, self.max_model_len, self.kv.capacity_tokens,
                                   self.config.kv_cache_memory, protected_tokens, hot_from)
        num_prompt = len(token_ids)
        if (keep or continues is not None) and (params.n > 1 or params.beam_width > 1):
            raise ValueError("kept sessions take one sequence per request: use n=1 without beam search")
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.requests or request_id in self.sessions:
            raise ValueError(f"request id {request_id!r} is already in use")
        grammar = self.grammars.constraint(params.response_format) if params.response_format else None
        if continues is not None:
            seq = self.sessions.resume(continues, request_id, token_ids, params, max_tokens,
                                       self.eos_token_ids, self._rng, hot_from)
            seq.grammar = grammar
            self.scheduler.add(seq, kept=True)
            self.requests[request_id] = Request(request_id, prompt if isinstance(prompt, str) else None,
                                                 token_ids, [seq], stream, keep)
            self.counters.prompt_tokens += num_prompt - seq.num_computed_tokens
            return request_id
        seqs = []
        for branch in range(params.n):
            generator = None
            if not params.greedy:
                seed = params.seed + branch if params.seed is not None else self._rng.getrandbits(63)
                generator = torch.Generator().manual_seed(seed)
            seq = Sequence(request_id, token_ids, params, self.eos_token_ids, generator, branch)
            seq.max_tokens = max_tokens
            seq.pinned_tokens = min(num_prompt, max(protected_tokens, self.config.sink_tokens))
            seq.hot_from = hot_from
            seq.grammar = grammar.copy() if grammar is not None else None  # one per branch
            seqs.append(seq)
        # Branches wait for the first one's prefill, then share its blocks (copy on write).
        seqs[0].forks = seqs[1:]
        if params.beam_width > 1:
            seqs[0].beam = BeamGroup.start(seqs[0], max_tokens, self.kv.num_blocks, self.kv.block_size,
                                           self.kv.local.num_groups * self.kv.local.window_blocks)
        self.scheduler.add(seqs[0])
        self.requests[request_id] = Request(request_id, prompt if isinstance(prompt, str) else None,
                                             token_ids, seqs, stream, keep)
        self.counters.prompt_tokens += num_prompt
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                self._finish(seq, "abort")
            seq.forks = []
        self.counters.requests_aborted += 1
        if self.kv_events is not None:
            self.kv_events.publish(self)
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step. Returns an output for each request that made progress."""
        outputs = self._step()
        if self.kv_events is not None:
            self.kv_events.publish(self)
        return outputs

    def _step(self) -> list[RequestOutput]:
        high = self.scheduler.watermarks.high * self.kv.num_blocks  # kept sessions give way first
        self.sessions.release_while(lambda: self.kv.num_used_blocks > high)
        batch = self.scheduler.schedule()
        while not batch and self.scheduler.has_work() and \
                (self.sessions.release_oldest() or self.scheduler.release_paused_pins(exclude=None)):
            batch = self.scheduler.schedule()  # (a running prompt's next chunk may need either's room)
        self.counters.pauses += len(batch.paused)
        self.counters.preemptions += sum(1 for seq in batch.paused if seq.num_computed_tokens == 0)
        if not batch:
            assert not self.scheduler.running or batch.paused, "running work but nothing scheduled"
            return []
        self.counters.steps += 1
        started = time.perf_counter()
        greedy = self._argmax_only(batch)
        result = self.runner.run(batch, greedy=greedy)  # with greedy: [S] token ids
        self._count_run(batch, result, started)
        prefilled = self._advance_chunks(batch)
        logits, sampled = self._advance_decodes(batch, result)
        if any(seq.forks for seq in sampled):
            logits, sampled = self._fork(logits, sampled)
        touched: dict[str, Request] = {}
        if any(seq.beam for seq in sampled):
            logits, sampled = step_beams(self, logits, sampled, touched)
        if sampled:
            self._sample(logits, sampled, greedy, touched)
        self.scheduler.end_step(prefilled)
        outputs = []
        for request in touched.values():
            done = all(seq.is_finished for seq in request.seqs)
            if done:
                del self.requests[request.request_id]
                self.counters.requests_finished += 1
            if done or request.stream:
                outputs.append(self._output(request))
        return outputs

    def _count_run(self, batch: ScheduledBatch, result: StepResult, started: float) -> None:
        if self.tier_loader is not None:  # the recompute rate its cost model weighs loads against
            self.tier_loader.observe_step(batch, time.perf_counter() - started)
        if batch.decodes:
            self.counters.decode_seconds += time.perf_counter() - started
            self.counters.hot_blocks_read += result.hot_reads
        if result.cold is not None:
            self.counters.sparse_selected_blocks += result.cold.selected_blocks
            self.counters.sparse_candidate_blocks += result.cold.candidate_blocks
            self.counters.dequant_seconds += result.cold.dequant_seconds

    def _advance_chunks(self, batch: ScheduledBatch) -> list[Sequence]:
        """Prefill, layered and replay chunks are computed: move each sequence on, commit its
        full blocks, check replayed blocks. Returns the sequences whose prompt is now done."""
        replay, prefilled = self.scheduler.replay, []
        for seq, chunk in batch.prefills:
            start = seq.num_computed_tokens
            seq.stats.replayed_tokens += replay.replayed_tokens(seq, start, start + chunk)
            if self.kv.dropped_blocks(seq.seq_id):
                seq.note_approx(start, chunk)  # attended without its dropped ranges
            seq.num_computed_tokens += chunk
            self.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.approx_from)
            if seq.num_uncomputed_tokens == 0:
                prefilled.append(seq)
        for seq, _ in batch.layers:
            state = seq.layered
            if state.next_layer < self.model_config.num_layers:
                continue
            seq.stats.replayed_tokens += replay.replayed_tokens(seq, state.start, state.end)
            seq.num_computed_tokens = state.end
            self.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens, through_dropped=True)
            self.kv.end_layered(seq.seq_id)
            seq.layered = None
            prefilled.append(seq)
        for chunk in batch.replays:
            mismatches = replay.check_replayed(chunk.seq, chunk.block_indices, chunk.num_tokens)
            if mismatches:  # the replay did not reproduce the dropped K/V: recompute it all
                self.counters.replay_mismatches += mismatches
                self.scheduler.recompute(chunk.seq)
        return prefilled

    def _advance_decodes(self, batch: ScheduledBatch, result: StepResult) -> tuple[torch.Tensor, list[Sequence]]:
        """Decode rows are computed: commit each, except those the need detector judged to
        lack a needed range (they replay it, then redo this step). Returns the rows that sample."""
        fired = self.scheduler.replay.judge_needs(result.needs)
        self.counters.need_checks += len(result.needs)
        self.counters.need_fires += len(fired)
        for seq in batch.decodes:
            if seq in fired:
                self.kv.truncate(seq.seq_id, seq.num_computed_tokens)
                continue
            if self.kv.dropped_blocks(seq.seq_id):
                seq.note_approx(seq.num_computed_tokens, 1)
            seq.num_computed_tokens += 1
            self.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.approx_from)
            self.scheduler.replay.token_committed(seq)
        logits, sampled = result.logits, result.sampled
        if fired:
            keep = [row for row, seq in enumerate(sampled) if seq not in fired]
            logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
            sampled = [sampled[row] for row in keep]
        return logits, sampled

    def _sample(self, logits: torch.Tensor, sampled: list[Sequence], greedy: bool,
                touched: dict[str, Request]) -> None:
        """Pick each row's next token (given already when `greedy`), with its logprobs."""
        params = [seq.params for seq in sampled]
        constrained = [row for row, seq in enumerate(sampled) if seq.grammar is not None]
        if constrained:  # never with `greedy`: a constrained row needs its logits
            self.grammars.mask(logits, constrained, [sampled[row].grammar for row in constrained],
                               [sampled[row].tokens_left(self.max_model_len) for row in constrained])
        tokens = logits if greedy else sample(logits, params, [seq.generator for seq in sampled])
        chosen_ids = tokens.tolist()  # one read of the tokens (one sync on a GPU)
        logprob_rows = rows_logprobs(logits, tokens, chosen_ids, params)
        for row, seq in enumerate(sampled):
            self._append(seq, chosen_ids[row], logprob_rows.get(row))
            touched[seq.request_id] = self.requests[seq.request_id]

    @staticmethod
    def _argmax_only(batch: ScheduledBatch) -> bool:
        """Whether every sequence that may sample this step takes the plain greedy token
        (temperature 0, no logprobs, no forks, beams or grammar): then the model hands back the
        tokens instead of logits."""
        seqs = batch.decodes + [seq for seq, _ in batch.prefills] + [seq for seq, _ in batch.layers]
        return all(seq.params.greedy and seq.params.logprobs is None and not seq.forks and seq.beam is None
                   and seq.grammar is None for seq in seqs)

    def _fork(self, logits: torch.Tensor, sampled: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """Start the waiting branches of each sequence that just finished its prompt: they share
        its blocks and sample their first token from its logits row with their own generator."""
        rows, seqs = [], []
        for row, seq in enumerate(sampled):
            rows.append(row)
            seqs.append(seq)
            for child in seq.forks:
                self.scheduler.fork(seq, child)
                rows.append(row)
                seqs.append(child)
            seq.forks = []
        return logits[torch.tensor(rows, device=logits.device)], seqs

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        seq.token_ids.append(token)
        seq.stats.completion_tokens += 1
        self.counters.generation_tokens += 1
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        request = self.requests[seq.request_id]
        if seq.params.stop or request.stream:
            self._detokenize(seq)
            if self._hit_stop_string(seq):
                return self._end(seq, "stop")
        if seq.grammar is not None and self.grammars.accept(seq.grammar, token):
            return self._end(seq, "stop")  # the JSON value is complete (or EOS ended it)
        if token in seq.stop_ids:
            return self._end(seq, "stop")
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return self._end(seq, "length")

    def _detokenize(self, seq: Sequence) -> None:
        seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        cut = min((i for i in (seq.text.find(s) for s in seq.params.stop) if i >= 0), default=-1)
        if cut < 0:
            return False
        seq.text = seq.text[:cut]
        return True

    def release(self, request_id: str) -> bool:
        """Free a kept session (`add_request(keep=True)`); False when none has that id."""
        return self.sessions.release(request_id)

    def _end(self, seq: Sequence, reason: str) -> None:
        keep = self.requests[seq.request_id].keep
        self.scheduler.remove(seq, free=not keep)
        if keep:
            self.sessions.park(seq)
        if reason != "stop" or not seq.params.stop:
            self._detokenize(seq)
        self._finish(seq, reason)

    @staticmethod
    def _finish(seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.grammar = None  # an aborted or finished request keeps no grammar state

    # ------------------------------------------------------------------ beam search's host (beam.BeamHost)
    def request_of(self, seq: Sequence) -> Request:
        return self.requests[seq.request_id]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.scheduler.fork(parent, child)

    def prune(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def complete(self, seq: Sequence, reason: str) -> None:
        self._detokenize(seq)
        self._finish(seq, reason)

    def count_generated(self) -> None:
        self.counters.generation_tokens += 1

    @staticmethod
    def _output(request: Request) -> RequestOutput:
        return request.output()

    def check_integrity(self) -> None:
        """KV pool invariants plus: each live sequence owns room for exactly its computed tokens."""
        self.kv.check_integrity()
        for seq in self.scheduler.running:
            # a layered prefill holds room for its whole range from the start
            expected = seq.layered.end if seq.layered is not None else seq.num_computed_tokens
            assert self.kv.num_slots(seq.seq_id) == expected, \
                f"seq {seq.seq_id}: {self.kv.num_slots(seq.seq_id)} slots, {expected} expected"
        for seq in [*self.scheduler.waiting, *self.sessions.sequences()]:  # waiting, paused or kept
            assert self.kv.num_slots(seq.seq_id) == seq.num_computed_tokens, \
                f"waiting or kept seq {seq.seq_id} holds {self.kv.num_slots(seq.seq_id)} slots"
        if not self.requests and not self.sessions:
            assert self.kv.num_free_blocks == self.kv.num_blocks, "idle engine holds blocks"

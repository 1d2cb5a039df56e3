"""Per-request bookkeeping: tokens, progress, finish state and counters.

A Sequence never touches KV blocks itself; its block table lives in the KV manager.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from kvreplay.outputs import RequestStats
from kvreplay.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class ReplayState:
    """A sequence's replay bookkeeping. Only the replay tracker (engine/replay.py) changes it."""
    end: int = 0                 # tokens computed before the last pause; below it, prefill is replay
    needed: bool = False         # the need detector fired: replay dropped ranges, redo the step
    until: int | None = None     # ... up to and including this dropped block (None: all of them)
    active: bool = False         # a replay of dropped ranges is under way (counted once)
    last_step: int = -1          # scheduler step of the last replay: trimmed last under pressure
    judged: set[int] = field(default_factory=set)  # blocks the detector asked for since the last token
    kept: set[int] = field(default_factory=set)    # replay_hold="judged": blocks it ever asked for
    cleared: set[int] = field(default_factory=set)  # ... and those cut after its replay: not probed


@dataclass
class LayeredPrefill:
    """Tokens [start, end) of a sequence computed one layer at a time (`layered_prefill`):
    the scheduler hands out layers, the runner carries the residual stream between steps."""
    start: int
    end: int
    new_blocks: list[int]         # table indices the KV manager began for the range
    next_layer: int = 0
    hidden: torch.Tensor | None = None  # [end - start, hidden]: the stream after next_layer - 1
    mass: torch.Tensor | None = None    # [blocks up to end]: the last queries' block mass so far


_ids = itertools.count()


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int], generator: torch.Generator | None, branch: int = 0):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.branch = branch
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + generated
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
        self.generator = generator
        self.logprobs: list[dict[int, float]] = []
        self.text = ""        # detokenized output (stop strings trimmed once finished)
        self.stats = RequestStats(prompt_tokens=len(prompt_token_ids))
        self.max_tokens: int = params.max_tokens or 0  # filled in by the engine when None
        self.pinned_tokens = 0  # head kept through a pause: protected span and sinks
        self.replay = ReplayState()
        self.hot_from: int | None = None  # first token of a chat's last rounds: kept hot by cold presets
        self.forks: list[Sequence] = []  # n > 1: branches that share this prompt's blocks once
                                         # its prefill is done
        self.beam = None  # the BeamGroup this sequence is a beam of (beam_width > 1)
        self.layered: LayeredPrefill | None = None  # a layered prefill under way
        self.grammar = None  # structured output: its Constraint (engine/grammar.py), dropped
                             # when the sequence finishes
        self.approx_from: int | None = None  # first position computed without some dropped range

    def note_approx(self, start: int, count: int) -> None:
        """Positions [start, start + count) were computed attending without a dropped range."""
        self.stats.approx_tokens += count
        self.approx_from = start if self.approx_from is None else min(self.approx_from, start)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def tokens_left(self, max_model_len: int) -> int:
        """Tokens it may still sample, counting the next one: up to max_tokens or the context."""
        return min(self.max_tokens - self.num_output_tokens, max_model_len - self.num_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens still lacking K/V: the prompt (or the dropped range, after a pause) while
        prefilling, exactly 1 (the newest sampled token) while decoding."""
        return len(self.token_ids) - self.num_computed_tokens

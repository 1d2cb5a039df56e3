"""What generation returns: one RequestOutput per prompt, one CompletionOutput per branch."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    """The counters of docs/architecture.md §5, per request; zero where a policy does not act."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefix_hit_tokens: int = 0
    dropped_tokens: int = 0
    replays: int = 0
    replayed_tokens: int = 0
    cold_blocks: int = 0
    approx_tokens: int = 0
    pauses: int = 0
    replay_mismatches: int = 0
    preemptions: int = 0  # pauses that kept nothing (vLLM-style recompute)
    # The session tier (engine/tier_loads.py): tokens read back instead of recomputed; tokens
    # the tier held but recompute was predicted cheaper; predicted and measured seconds of loads.
    tier_loaded_tokens: int = 0
    tier_overlapped_tokens: int = 0  # of those, read in the background while a head was recomputed
    tier_recomputed_tokens: int = 0
    tier_predicted_seconds: float = 0.0
    tier_actual_seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None           # "stop", "length", "abort" or None while running
    logprobs: list[dict[int, float]] | None
    stats: RequestStats


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False

    # The first completion's fields, for the common n=1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs

    @property
    def stats(self) -> RequestStats:
        return self.outputs[0].stats

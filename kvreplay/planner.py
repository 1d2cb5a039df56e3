"""Capacity planner: KV bytes per token, per request, and concurrency per budget under each policy.

Notation: L layers, H KV heads, D head dim, g = L x H x D channels (of K, or of V), e bytes per
element of the hot KV dtype, bs tokens per block, T tokens of context.

    bytes per token = 2 (K and V) x L x H x D x e           (SmolLM2-135M, bf16: 23,040)
    block bytes     = bs x bytes per token
    blocks          = ceil(T / bs); rounding waste = blocks x bs - T tokens

Zones (docs/architecture.md §4) in whole blocks. P = max(protected_tokens, sink_tokens), W = window_tokens:

    token     0                 P                               T-W              T
              | protected+sinks |            middle              |    window     |
    block     [0, ceil(P/bs))   [ceil(P/bs), floor((T-W)/bs))    [floor((T-W)/bs), ceil(T/bs))

A block holding any protected, sink or window token stays hot; only whole middle blocks (m of
them) change state. When T <= P + W there is no middle and every policy equals `full`.

Resident bytes of one request under each policy (scales and summaries are fp16, 2 bytes):

    full          all blocks hot                        = blocks x block bytes
    window        hot blocks only; the middle is evicted for good (StreamingLLM)
    replay        hot blocks + m x key index (the middle is dropped) of the n layers the detector
                  reads (`index_layers`, default every one), gn = n x H x D: bs x gn x index_bits/8
                  + 2 x gn x 2 (codes, then per-channel key min and max, the Quest summaries too)
    sparse:C      hot blocks + m x (cold data + cold scales + summaries); the middle is cold
                    cold data    = 2 x bs x g x bits(C)/8  int8/fp8: 1/2 of bf16, int4: 1/4
                    cold scales  = 2 x g x groups(C) x 2   int8/fp8: a scale; int4: scale and min
    replay+cold:C between sparse:C (while cold fits) and replay (everything dropped); planned at
                  replay, what it falls back to when memory is short
    snapkv, h2o   the published baselines at resident_ratio r: floor(r x blocks) hot, the rest
                  evicted for good (never fewer than the pinned head and the recent window:
                  snapkv the blocks of the prompt's last 32 tokens, h2o one block)
    quest         all blocks hot (full's bytes); each step attends to floor(r x blocks) of them

    max concurrency for a budget B = floor(B / resident bytes of one request)

The cold and index layouts are assumptions until those tiers exist in the engine; change
COLD_FORMATS (or re-register the policy) when they land. A new policy plugs in with
`register_policy(name, resident_fn)`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from kvreplay.validate import check_choice, check_int, check_number

SCALE_BYTES = 2     # fp16 scale / min per quantization group
SUMMARY_BYTES = 2   # fp16 key min / max per block and channel

INDEX_BITS = (2, 4, 8)  # widths of the replay key index
KV_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
                  "int8": 1, "fp8": 1}


@dataclass(frozen=True)
class ColdFormat:
    """A quantized cold-tier layout: `bits` per element, `groups` fp16 values per block-channel."""
    bits: int
    groups: int


COLD_FORMATS = {"int8": ColdFormat(8, 1), "fp8": ColdFormat(8, 1), "int4": ColdFormat(4, 2)}


@dataclass(frozen=True)
class LayerGroup:
    """Layers that need the same span of K/V: global ones every token, local (sliding-window)
    ones their last `window_tokens` (docs/architecture.md, "Gemma 3")."""
    name: str
    num_layers: int
    bytes_per_token: int      # K and V of one token over the group's layers
    window_tokens: int | None

    def needed_tokens(self, context_tokens: int, block_size: int) -> int:
        """Tokens of whole blocks the group needs at `context_tokens`: a window that does not
        start on a block boundary touches one block more than it fills."""
        blocks = -(-context_tokens // block_size)
        if self.window_tokens is not None:
            blocks = min(blocks, -(-self.window_tokens // block_size) + 1)
        return blocks * block_size


@dataclass(frozen=True)
class KVDims:
    """The model facts the KV cache depends on. `num_local_layers` of the layers attend to
    their last `sliding_window` tokens only (0: none)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int | None = None
    max_context_tokens: int | None = None
    source: str = "explicit dimensions"
    num_local_layers: int = 0
    sliding_window: int | None = None

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            check_int(name, getattr(self, name), 1)

    @classmethod
    def from_model_config(cls, config, source: str) -> "KVDims":
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, config.num_heads,
                   config.max_position_embeddings, source, len(config.local_layers), config.sliding_window)

    def layer_groups(self, dtype_bytes: float = 2) -> list[LayerGroup]:
        """The global layers, then the local ones where the model has any."""
        per_layer = 2 * self.num_kv_heads * self.head_dim * dtype_bytes
        num_global = self.num_layers - self.num_local_layers
        groups = [LayerGroup("global", num_global, int(num_global * per_layer), None)]
        if self.num_local_layers:
            groups.append(LayerGroup("local", self.num_local_layers, int(self.num_local_layers * per_layer),
                                     self.sliding_window))
        return groups

    @classmethod
    def from_hidden(cls, num_layers: int, hidden_size: int, num_heads: int | None = None,
                    num_kv_heads: int | None = None) -> "KVDims":
        """MHA shorthand (K and V as wide as the hidden state) unless heads say otherwise."""
        if num_heads is None:
            if num_kv_heads is not None:
                raise ValueError("with --hidden-size, give --num-heads too when --num-kv-heads is set")
            # Bytes depend only on the K/V width (= hidden for MHA); the head split is cosmetic.
            head_dim = 128 if hidden_size % 128 == 0 else hidden_size
            return cls(num_layers, hidden_size // head_dim, head_dim,
                       source=f"explicit dimensions: MHA, K/V as wide as hidden {hidden_size}")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
        return cls(num_layers, num_kv_heads or num_heads, hidden_size // num_heads, num_heads,
                   source="explicit dimensions")

    @property
    def channels(self) -> int:
        """g = L x H x D: elements of K (or of V) for one token over all layers."""
        return self.num_layers * self.num_kv_heads * self.head_dim

    def bytes_per_token(self, dtype_bytes: float = 2) -> int:
        return int(2 * self.channels * dtype_bytes)


@dataclass(frozen=True)
class PlanKnobs:
    block_size: int = 16
    sink_tokens: int = 4
    window_tokens: int = 512
    protected_tokens: int = 0
    kv_dtype: str = "bfloat16"
    index_bits: int = 4
    resident_ratio: float | None = None  # the budget of snapkv, h2o and quest
    index_layers: int | None = None      # layers replay's key index keeps (None: every one a dropped block leaves)

    def __post_init__(self):
        check_choice("KV dtype", self.kv_dtype, KV_DTYPE_BYTES)
        check_int("block_size", self.block_size, 1)
        for name in ("sink_tokens", "window_tokens", "protected_tokens"):
            check_int(name, getattr(self, name), 0)
        check_choice("index_bits", self.index_bits, INDEX_BITS)
        check_int("index_layers", self.index_layers, 0, optional=True)
        check_number("resident_ratio", self.resident_ratio, 0, 1, low_open=True, optional=True,
                      what="a share of full KV")

    @property
    def dtype_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.kv_dtype]


@dataclass(frozen=True)
class Zones:
    """One request's blocks split into the ones that must stay hot and the middle."""
    context_tokens: int
    num_blocks: int
    num_middle_blocks: int

    @property
    def num_hot_blocks(self) -> int:
        return self.num_blocks - self.num_middle_blocks

    @classmethod
    def of(cls, context_tokens: int, knobs: PlanKnobs) -> "Zones":
        check_int("context length", context_tokens, 1)
        block_size = knobs.block_size
        num_blocks = -(-context_tokens // block_size)
        head_blocks = min(num_blocks, -(-max(knobs.protected_tokens, knobs.sink_tokens) // block_size))
        window_first_block = max(0, context_tokens - knobs.window_tokens) // block_size
        return cls(context_tokens, num_blocks, max(0, window_first_block - head_blocks))


@dataclass
class PolicyPlan:
    """Bytes one request keeps resident under a policy, by kind."""
    policy: str
    hot_blocks: int
    middle_state: str          # what happens to middle blocks: hot, evicted, dropped, cold
    middle_blocks: int
    hot_bytes: int
    cold_bytes: int = 0
    index_bytes: int = 0
    summary_bytes: int = 0
    max_concurrency: int | None = None
    hybrid_bytes: int | None = None  # a sliding-window model's hybrid pool, HYBRID_POLICIES only

    @property
    def resident_bytes(self) -> int:
        return self.hot_bytes + self.cold_bytes + self.index_bytes + self.summary_bytes

    def as_dict(self) -> dict:
        return asdict(self) | {"resident_bytes": self.resident_bytes}


ResidentFn = Callable[[Zones, PlanKnobs, KVDims, str | None], PolicyPlan]
_POLICIES: dict[str, ResidentFn] = {}


def register_policy(name: str, fn: ResidentFn) -> None:
    """Add (or replace) a policy's resident-bytes model; `fn(zones, knobs, dims, cold_dtype)`."""
    _POLICIES[name] = fn


def available_policies() -> list[str]:
    return list(_POLICIES)


def _block_bytes(dims: KVDims, knobs: PlanKnobs) -> int:
    return knobs.block_size * dims.bytes_per_token(knobs.dtype_bytes)


def _summary_bytes(zones: Zones, dims: KVDims) -> int:
    return zones.num_middle_blocks * 2 * dims.channels * SUMMARY_BYTES


def _full(zones, knobs, dims, cold_dtype):
    return PolicyPlan("full", zones.num_blocks, "hot", zones.num_middle_blocks,
                      zones.num_blocks * _block_bytes(dims, knobs))


def _window(zones, knobs, dims, cold_dtype):
    return PolicyPlan("window", zones.num_hot_blocks, "evicted", zones.num_middle_blocks,
                      zones.num_hot_blocks * _block_bytes(dims, knobs))


def _replay(zones, knobs, dims, cold_dtype):
    layers = dims.num_layers - dims.num_local_layers if knobs.index_layers is None else knobs.index_layers
    read = layers * dims.num_kv_heads * dims.head_dim
    per_block = knobs.block_size * read * knobs.index_bits // 8 + 2 * read * SUMMARY_BYTES
    return PolicyPlan("replay", zones.num_hot_blocks, "dropped", zones.num_middle_blocks,
                      zones.num_hot_blocks * _block_bytes(dims, knobs),
                      index_bytes=zones.num_middle_blocks * per_block)


def _sparse(zones, knobs, dims, cold_dtype):
    fmt = COLD_FORMATS[cold_dtype or "int8"]
    per_block = (2 * knobs.block_size * dims.channels * fmt.bits // 8
                 + 2 * dims.channels * fmt.groups * SCALE_BYTES)
    return PolicyPlan(f"sparse:{cold_dtype or 'int8'}", zones.num_hot_blocks, "cold",
                      zones.num_middle_blocks, zones.num_hot_blocks * _block_bytes(dims, knobs),
                      cold_bytes=zones.num_middle_blocks * per_block,
                      summary_bytes=_summary_bytes(zones, dims))


def _replay_cold(zones, knobs, dims, cold_dtype):
    return replace(_replay(zones, knobs, dims, cold_dtype), policy=f"replay+cold:{cold_dtype or 'int8'}")


def _ratio_blocks(zones: Zones, knobs: PlanKnobs, name: str, recent_tokens: int) -> int:
    """Blocks a baseline keeps at resident_ratio: floor(r x blocks), never fewer than the pinned
    head and the blocks holding the last `recent_tokens` tokens."""
    if knobs.resident_ratio is None:
        raise ValueError(f"policy {name} is defined by its budget: give --resident-ratio (e.g. 0.25)")
    T, bs = zones.context_tokens, knobs.block_size
    head = min(zones.num_blocks, -(-max(knobs.protected_tokens, knobs.sink_tokens) // bs))
    always = head + zones.num_blocks - max(head, max(0, T - recent_tokens) // bs)
    return min(zones.num_blocks, max(always, int(knobs.resident_ratio * zones.num_blocks + 1e-9)))


def _evicting(name: str, recent_tokens: int):
    def plan_one(zones, knobs, dims, cold_dtype):
        hot = _ratio_blocks(zones, knobs, name, recent_tokens)
        return PolicyPlan(name, hot, "evicted", zones.num_blocks - hot, hot * _block_bytes(dims, knobs))
    return plan_one


def _quest(zones, knobs, dims, cold_dtype):
    attended = _ratio_blocks(zones, knobs, "quest", 1)
    return PolicyPlan("quest", zones.num_blocks, "hot, unread", zones.num_blocks - attended,
                      zones.num_blocks * _block_bytes(dims, knobs))


for _name, _fn in (("full", _full), ("window", _window), ("replay", _replay), ("sparse", _sparse),
                   ("replay+cold", _replay_cold), ("snapkv", _evicting("snapkv", 32)),
                   ("h2o", _evicting("h2o", 1)), ("quest", _quest)):
    register_policy(_name, _fn)

DEFAULT_POLICIES = ["full", "window", "replay", "sparse:int8", "sparse:fp8", "sparse:int4"]
# What the engine serves on a sliding-window model (engine/model_setup.py), acting on its global
# layers only: those keep the policy's hot blocks, the local layers their window.
HYBRID_POLICIES = ("full", "window", "replay", "sparse", "snapkv", "h2o", "quest")


def parse_policy(spec: str) -> tuple[str, str | None]:
    """`"sparse:int4"` -> ("sparse", "int4"); `"replay"` -> ("replay", None)."""
    name, _, cold = spec.strip().partition(":")
    if name not in _POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(_POLICIES)} "
                         f"(cold dtype as a suffix, e.g. sparse:int4)")
    if cold and cold not in COLD_FORMATS:
        raise ValueError(f"unknown cold dtype {cold!r} in {spec!r}; use {', '.join(COLD_FORMATS)}")
    return name, cold or None


@dataclass
class RequestPlan:
    """Everything the planner says about one context length."""
    context_tokens: int
    bytes_per_token: int
    block_bytes: int
    num_blocks: int
    waste_tokens: int
    budget_bytes: int | None
    policies: list[PolicyPlan] = field(default_factory=list)
    # The session tier (kv/session_tier.py) keeps a session's full blocks: sessions of this
    # context each of its levels holds ('memory', 'disk'), for the budgets planned.
    tier_sessions: dict[str, int] = field(default_factory=dict)
    # Per layer group: bytes per token, and the bytes a hybrid pool would hold for this context
    # (local layers only their window, kv/local_groups.py; every layer's blocks: `full_bytes`).
    layer_groups: list[dict] = field(default_factory=list)

    @property
    def hybrid_bytes(self) -> int:
        return sum(group["hybrid_bytes"] for group in self.layer_groups)

    @property
    def full_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def policy(self, name: str) -> PolicyPlan:
        return next(p for p in self.policies if p.policy == name or p.policy.split(":")[0] == name)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["policies"] = [p.as_dict() for p in self.policies]
        out["hybrid_bytes"] = self.hybrid_bytes
        return out


TIER_FILE_HEADER_BYTES = 512  # a disk tier file's header (stamp, hash, tokens, checksum), at most about


def tier_sessions(block_bytes: int, context_tokens: int, block_size: int, memory_bytes: int = 0,
                  disk_bytes: int = 0) -> dict[str, int]:
    """Sessions of `context_tokens` the session tier's memory and disk levels hold: their full
    blocks (a partial last block is recomputed), a disk file's header counted per block."""
    full_blocks = max(1, context_tokens // block_size)
    out = {}
    if memory_bytes:
        out["memory"] = memory_bytes // (full_blocks * block_bytes)
    if disk_bytes:
        out["disk"] = disk_bytes // (full_blocks * (block_bytes + TIER_FILE_HEADER_BYTES))
    return out


def plan(dims: KVDims, context_tokens: int, knobs: PlanKnobs = PlanKnobs(),
         budget_bytes: int | None = None, policies: list[str] | None = None,
         tier_memory_bytes: int = 0, tier_disk_bytes: int = 0) -> RequestPlan:
    """Per-request KV bytes at `context_tokens` under each policy, how many fit `budget_bytes`,
    and how many sessions the session tier's budgets hold."""
    zones = Zones.of(context_tokens, knobs)
    result = RequestPlan(context_tokens, dims.bytes_per_token(knobs.dtype_bytes),
                         _block_bytes(dims, knobs), zones.num_blocks,
                         zones.num_blocks * knobs.block_size - context_tokens, budget_bytes)
    for spec in policies or DEFAULT_POLICIES:
        name, cold = parse_policy(spec)
        policy_plan = _POLICIES[name](zones, knobs, dims, cold)
        if budget_bytes is not None:
            policy_plan.max_concurrency = budget_bytes // policy_plan.resident_bytes
        result.policies.append(policy_plan)
    result.tier_sessions = tier_sessions(result.block_bytes, context_tokens, knobs.block_size,
                                         tier_memory_bytes, tier_disk_bytes)
    for group in dims.layer_groups(knobs.dtype_bytes):
        tokens = group.needed_tokens(context_tokens, knobs.block_size)
        result.layer_groups.append(asdict(group) | {"hybrid_tokens": tokens,
                                                    "hybrid_bytes": tokens * group.bytes_per_token})
    if dims.num_local_layers:  # the global layers' share of a row, plus the local windows
        local_bytes, share = result.hybrid_bytes - result.layer_groups[0]["hybrid_bytes"], \
            result.layer_groups[0]["bytes_per_token"] / result.bytes_per_token
        for p in result.policies:  # (replay's index counts the global layers it reads already)
            if p.policy.split(":")[0] in HYBRID_POLICIES:
                p.hybrid_bytes = round((p.resident_bytes - p.index_bytes) * share) + p.index_bytes + local_bytes
    return result


def format_bytes(num_bytes: float) -> str:
    """`17179869184` -> `17.18 GB (16.00 GiB)`: decimal as the seeds quote, binary as budgets are."""
    if num_bytes < 1000:
        return f"{int(num_bytes)} B"
    decimal = next((num_bytes / 10**p, u) for p, u in ((12, "TB"), (9, "GB"), (6, "MB"), (3, "kB"))
                   if num_bytes >= 10**p)
    binary = next((num_bytes / 2**p, u) for p, u in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B"))
                  if num_bytes >= 2**p)
    return f"{decimal[0]:.2f} {decimal[1]} ({binary[0]:.2f} {binary[1]})"

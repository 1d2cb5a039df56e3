"""One validated configuration for the engine; Python keywords and CLI flags all land here."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from kvreplay.kv.policy import PAUSE_MODES, POLICIES, TRIM_MODES, TRIM_ORDERS, Watermarks
from kvreplay.validate import parse_bytes  # re-exported: kvreplay.config.parse_bytes

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {value}; use float32, bfloat16 or float16")
        return value
    if value not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[value]


def parse_layers(value) -> frozenset[int] | None:
    """None, an iterable of ints, or a string like "7,20-23" -> a set of layer indices."""
    if value is None:
        return None
    if isinstance(value, str):
        layers = set()
        try:
            for part in value.split(","):
                first, _, last = part.strip().partition("-")
                layers.update(range(int(first), int(last or first) + 1))
        except ValueError:
            raise ValueError(f"cannot parse layers {value!r}: use e.g. '20-23' or '7,20-23'") from None
    else:
        layers = set(value)
    if not layers or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
        raise ValueError(f"layers must be non-negative integers, got {value!r}")
    return frozenset(layers)


DEVICE_ENV = "KVREPLAY_DEVICE"


def default_device() -> str:
    """The device an engine runs on when none is named: $KVREPLAY_DEVICE, else "cpu"."""
    return os.environ.get(DEVICE_ENV) or "cpu"


def check_device(device) -> None:
    """A ValueError unless `device` is "cpu" or "cuda[:N]" with a GPU that torch sees."""
    if not isinstance(device, str) or not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch sees no CUDA GPU; use device='cpu'")


@dataclass
class EngineConfig:
    """Knobs of one engine.

    Attributes:
        model: a .gguf file, a Hugging Face directory, or None for the embedded SmolLM2-135M.
        dtype: weights, activations and KV cache ("float32" for exactness, "bfloat16" for speed).
        device: "cpu" or "cuda[:N]" (default: $KVREPLAY_DEVICE, else "cpu").
        kv_cache_memory: bytes of KV cache (int or "256MiB").
        block_size: tokens per KV block.
        max_num_batched_tokens: token budget of one step (decodes + prefill chunks).
        max_num_seqs: sequences in the running batch at most.
        max_model_len: longest prompt + output; defaults to the model's context.
        policy: KV policy preset; "full" keeps every block hot.
        sink_tokens: first tokens of every sequence kept through a pause (StreamingLLM sinks).
        watermarks: (low, admit, high) fractions of the pool, or "0.6,0.7,0.85": reclaim
            starts above high and stops under low; new work is admitted while usage after
            admitting it stays under admit.
        enable_prefix_caching: reuse the K/V of full blocks whose whole prefix matches.
        pause_mode: "protected" keeps a paused sequence's protected span and sinks;
            "recompute" drops all of it (vLLM's recompute preemption).
        window_tokens: the recent window every policy keeps hot (window, replay).
        trim: when `replay` drops middle blocks: "pressure" (only when usage crosses the high
            watermark, oldest middle blocks first) or "prefill" (right after each prompt's
            prefill: long pasted documents).
        replay_threshold: when one dropped block would take more than this share of some head's
            attention, the need detector brings that block back exactly: from the prefix cache
            if it is still there, else by replaying the dropped ranges in order up to it; then
            the step is redone (0 = always replay, every dropped range).
        need_top_blocks: dropped blocks per KV head the detector scores from the key index
            (the Quest bound picks them).
        approx_prefill: a prefill chunk of a sequence with dropped ranges attends to what is
            resident instead of replaying them first.
        need_layers: layers the need detector reads, e.g. "20-23" or "7,20-23" (None: all).
            `python bench/need_probe.py` shows where a model's retrieval heads are; on
            SmolLM2-135M layers 20-23 carry them (docs/benchmarks/replay.md).
        cold_dtype: storage of cold blocks (sparse, replay+cold): "int8", "fp8" or "int4".
        sparse_budget: tokens of cold blocks each decode step attends to per KV head, chosen
            by the Quest bound of their key summaries; None attends to every cold block.
        dense_layers: the first layers attend to every cold block whatever sparse_budget says.
        heavy_tokens: middle blocks with the most observed attention (kvreplay.kv.importance:
            the prompt's last queries, then every decode step), up to this many tokens per
            sequence, stay hot beside the window (H2O's heavy hitters; 0: none).
        trim_order: which middle blocks reclaim demotes or drops first: "importance" (least
            observed attention first) or "oldest" (lowest positions first).
        resident_ratio: dropping presets (replay, replay+cold): after each step, a decoding
            sequence whose resident KV (hot + cold + key index) is above this share of what
            `full` would hold drops middle blocks, least important first (cold ones in
            replay+cold), until it is not (None: no per-sequence cap).
        layered_prefill: a prompt (or resumed range) whose middle a dropping preset drops
            right after its prefill (replay with trim="prefill", window) is computed one layer
            at a time over its whole range: only one layer's K/V of the middle exists at once,
            so admitting it needs the blocks it keeps (sinks, window, key index) plus working
            memory instead of its whole K/V. The K/V kept are bit for bit those of the
            chunked prefill. Heavy hitters are chosen among the middle's last
            8 x heavy_tokens; the dropped middle never enters the prefix cache, so a
            replay recomputes what a chunked prefill's cached blocks would give back free.
        hot_turns: chat rounds (a user message and what follows it) at the end of a chat that
            the cold presets keep in full precision beside the system prompt (the seeds'
            multi-turn rule; 0: only the window).
    """
    model: str | None = None
    dtype: str | torch.dtype = "bfloat16"
    device: str = field(default_factory=default_device)
    kv_cache_memory: int | str = "256MiB"
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    policy: str = "full"
    seed: int = 0
    sink_tokens: int = 4
    watermarks: tuple[float, float, float] | str | Watermarks = (0.60, 0.70, 0.85)
    enable_prefix_caching: bool = True
    pause_mode: str = "protected"
    window_tokens: int = 512
    trim: str = "pressure"
    replay_threshold: float = 0.65
    need_top_blocks: int = 8
    approx_prefill: bool = False
    need_layers: str | tuple[int, ...] | None = None
    cold_dtype: str = "int8"
    sparse_budget: int | None = None
    dense_layers: int = 0
    heavy_tokens: int = 0
    trim_order: str = "importance"
    hot_turns: int = 2
    resident_ratio: float | None = None
    layered_prefill: bool = False

    def __post_init__(self):
        self.torch_dtype = parse_dtype(self.dtype)
        self.kv_cache_bytes = parse_bytes(self.kv_cache_memory)
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len <= 0):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if not isinstance(self.sink_tokens, int) or isinstance(self.sink_tokens, bool) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an integer >= 0, got {self.sink_tokens!r}")
        self.watermark_levels = Watermarks.parse(self.watermarks)
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause_mode {self.pause_mode!r}; use one of {', '.join(PAUSE_MODES)}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; available: {', '.join(POLICIES)}")
        self.kv_policy = POLICIES[self.policy]
        for name in ("window_tokens", "need_top_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.trim not in TRIM_MODES:
            raise ValueError(f"unknown trim {self.trim!r}; use one of {', '.join(TRIM_MODES)}")
        if isinstance(self.replay_threshold, bool) or not isinstance(self.replay_threshold, (int, float)) \
                or not 0 <= self.replay_threshold <= 1:
            raise ValueError(f"replay_threshold is a share of attention in [0, 1], got {self.replay_threshold!r}")
        self.need_layer_set = parse_layers(self.need_layers)
        from kvreplay.kv.quant import KINDS
        if self.cold_dtype not in KINDS:
            raise ValueError(f"unknown cold_dtype {self.cold_dtype!r}; use one of {', '.join(KINDS)}")
        if self.sparse_budget is not None and (isinstance(self.sparse_budget, bool)
                                               or not isinstance(self.sparse_budget, int)
                                               or self.sparse_budget < self.block_size):
            raise ValueError(f"sparse_budget is a token count >= block_size ({self.block_size}) or "
                             f"None (attend to every cold block), got {self.sparse_budget!r}")
        if isinstance(self.dense_layers, bool) or not isinstance(self.dense_layers, int) \
                or self.dense_layers < 0:
            raise ValueError(f"dense_layers must be an integer >= 0, got {self.dense_layers!r}")
        for name in ("heavy_tokens", "hot_turns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.resident_ratio is not None and (isinstance(self.resident_ratio, bool)
                                                or not isinstance(self.resident_ratio, (int, float))
                                                or not 0 < self.resident_ratio <= 1):
            raise ValueError(f"resident_ratio is a share of full KV in (0, 1] or None, got {self.resident_ratio!r}")
        if self.trim_order not in TRIM_ORDERS:
            raise ValueError(f"unknown trim_order {self.trim_order!r}; use one of {', '.join(TRIM_ORDERS)}")
        for name in ("approx_prefill", "layered_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_device(self.device)

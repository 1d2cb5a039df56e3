"""The replay knobs a model needs, found by the model itself: which layers the need detector reads
and how many middle tokens stay hot as heavy hitters (docs/architecture.md §5, "Defaults").

A calibration pass plants a fact ("The secret number of <name> is <5 digits>.") in real text
(CPython's pydoc_data.topics) and runs each case once with full attention, observing attention in
every layer at two points of the same prompt:

    | sinks | text ... needle ... text ...  [ordinary]  text | question, answer digits [planted] |

- planted: the queries that copy the answer's digits (the decode steps that need the fact): per
  layer, the largest share any head gives the needle's blocks;
- ordinary: the last queries of plain text further on: per layer, the largest share any head
  gives one middle block other than the needle's (what would make the detector fire for
  nothing).

The detector reads the `ceil(layers / 8)` layers with the largest mean planted share less mean
ordinary share (retrieval heads sit in a few layers: 20-23 of SmolLM2-135M's 30). Its threshold
lies between the weakest planted and the loudest ordinary share on the layers it reads
(`choose_threshold`). The heavy-hitter
budget is the smallest number of middle blocks that held the needle's block among the most
observed ones (the prompt's last queries, as the engine scores them) in every case: at least 2,
at most 8 blocks. Models with fewer than 8 layers, or without a file to key the result by, skip
the pass and read every layer with 2 heavy blocks and a threshold of 0.65; a sliding-window
model (Gemma 3) skips it too and reads its last global layer: only global layers keep a dropped
block's keys, and with 3 global layers of 1 KV head each one read costs 6.25% of every dropped
block (all three: 0.17 of full's KV at 10% resident, more than the whole budget). Under a
`resident_ratio` r, auto reads no layer where the chosen layers' index would take more than an
eighth of the budget ((1 - r) x its share of a block > r / 8; in bf16: Gemma 3 at 25% and below,
SmolLM2's four layers (2.5%) at 10%): the detector is off, the whole budget holds hot blocks, and
dropped ranges come back when a prefill (a kept session's next turn) needs them. On the RULER
context-first slices that scored higher or the same (docs/benchmarks.md §3).

The result is cached under the user's cache directory ($XDG_CACHE_HOME, else ~/.cache), keyed by
the model file's sha256, the dtype and the block size, so the pass runs once per model and dtype
(six 1,024-token prefills).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvreplay.kv import KVManager
from kvreplay.kv.key_index import KeyIndex
from kvreplay.layers.attention import AttentionMetadata, PrefillSlice

logger = logging.getLogger(__name__)

VERSION = 2            # 2: the threshold is part of the result
CASES = 6
CASE_TOKENS = 1024
OBSERVED = 4           # queries observed at each point
WINDOW_TOKENS = 256    # kept hot at the ordinary point: not "middle"
MIN_LAYERS = 8
HEAVY_BLOCKS = (2, 8)  # the heavy-hitter budget's bounds, in blocks
THRESHOLD_FALLBACK = 0.65  # where no pass ran, or its layers do not tell a fact from plain text
INDEX_BUDGET = 0.125  # auto: the most of a resident_ratio budget the detector's key index may take
NAMES = ("the blue door", "the old lighthouse", "the north tower", "the copper key",
         "the night train", "the glass garden")


@dataclass(frozen=True)
class Calibration:
    need_layers: tuple[int, ...]
    heavy_tokens: int
    source: str                 # "calibrated", "cached" or why no pass ran
    planted: tuple[float, ...] = ()   # per layer: mean share on the needle at the answer
    ordinary: tuple[float, ...] = ()  # per layer: mean largest other middle block share
    planted_low: tuple[float, ...] = ()    # per layer: the smallest planted share of any case
    ordinary_high: tuple[float, ...] = ()  # per layer: the largest ordinary share of any case
    replay_threshold: float = THRESHOLD_FALLBACK  # for need_layers (choose_threshold)

    def describe(self) -> str:
        return (f"need_layers={format_layers(self.need_layers)}, heavy_tokens={self.heavy_tokens}, "
                f"replay_threshold={self.replay_threshold:g} ({self.source})")

    def threshold_for(self, layers) -> float:
        """The threshold for the detector reading `layers` (the configured ones may not be the
        calibrated ones); the fallback when no pass ran."""
        if not self.planted_low:
            return self.replay_threshold
        return choose_threshold(self.planted_low, self.ordinary_high, layers)


def choose_threshold(planted_low, ordinary_high, layers) -> float:
    """The need detector's threshold when it reads `layers`, from a calibration profile (per
    layer: the smallest share any case's planted fact took where its answer is copied, the
    largest share plain text gave one other middle block in any case).

    The detector fires on the largest share over the layers it reads, so each side is its
    largest over `layers`, and the threshold their geometric mean (shares compare as ratios: the
    detector subtracts log-sum-exps). The extremes, not the means: the detector fires on one
    step's largest share, and a threshold between the means (0.37 on SmolLM2-135M) fired on
    nearly every RULER request at 4K for blocks other than the fact's (docs/benchmarks.md §3).
    When the weakest fact takes no more than the loudest plain text, no threshold tells them
    apart: THRESHOLD_FALLBACK."""
    layers = sorted(layers)
    if not layers or max(layers) >= min(len(planted_low), len(ordinary_high)):
        raise ValueError(f"layers {format_layers(layers)} are not all in a profile of "
                         f"{min(len(planted_low), len(ordinary_high))} layers")
    fact = max(planted_low[i] for i in layers)
    plain = max(max(ordinary_high[i] for i in layers), 1e-3)  # never 0: that means replay always
    if fact <= plain:
        return THRESHOLD_FALLBACK
    return round(math.sqrt(fact * plain), 2)


def format_layers(layers) -> str:
    """(20, 21, 22, 23) -> "20-23"; (3, 7, 8) -> "3,7-8"."""
    parts, layers = [], sorted(layers)
    start = prev = None
    for layer in layers + [None]:
        if start is not None and layer == prev + 1:
            prev = layer
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = layer
    return ",".join(parts)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvreplay" / "calibration"


def model_digest(source: str) -> str | None:
    """sha256 of the model file (or of a model directory's weight and config files), None when
    there is no file. Hashed once per process and file version: every replay engine asks."""
    path = Path(source)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".json", ".gguf"))
    else:
        return None
    return _digest(tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@functools.lru_cache(maxsize=8)
def _digest(files: tuple[tuple[str, int, int], ...]) -> str:
    """sha256 over the files' bytes; the sizes and mtimes in the key make a rewritten file miss."""
    digest = hashlib.sha256()
    for file, _, _ in files:
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()


def cache_path(digest: str, dtype: torch.dtype, block_size: int) -> Path:
    return cache_dir() / f"{digest[:32]}-{str(dtype).removeprefix('torch.')}-b{block_size}-v{VERSION}.json"


def read_cached(path: Path) -> Calibration | None:
    """The calibration saved at `path`, None when there is none or it is damaged."""
    try:
        saved = json.loads(path.read_text())
        return Calibration(tuple(saved["need_layers"]), int(saved["heavy_tokens"]), f"cached in {path}",
                           tuple(saved["planted"]), tuple(saved["ordinary"]), tuple(saved["planted_low"]),
                           tuple(saved["ordinary_high"]), float(saved["replay_threshold"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def lookup(source: str, dtype: torch.dtype = torch.bfloat16, block_size: int = 16) -> Calibration | None:
    """The cached calibration of a model file, without running a pass (`kvreplay plan`)."""
    digest = model_digest(source)
    return None if digest is None else read_cached(cache_path(digest, dtype, block_size))


def local_layers_of(config) -> set[int]:
    """A sliding-window model's local layers (empty for every other model)."""
    return set(getattr(config, "local_layers", None) or ()) if getattr(config, "sliding_window", None) else set()


def sliding_window_defaults(model_config, block_size: int) -> Calibration | None:
    """A sliding-window model's knobs, by rule (no pass): the detector reads what a dropped block
    leaves, one global layer's keys (the last). None for other models."""
    local = local_layers_of(model_config)
    if not local:
        return None
    last_global = max(i for i in range(model_config.num_layers) if i not in local)
    return Calibration((last_global,), HEAVY_BLOCKS[0] * block_size,
                       "the last global layer: a sliding-window model's local layers keep no dropped "
                       "block, and its key index costs 6.25% of a dropped block per global layer read")


def calibrated_defaults(model, tokenizer, source: str, block_size: int, prefill_kernel=None) -> Calibration:
    """The cached calibration of this model and block size, else a fresh pass (then cached)."""
    num_layers = model.config.num_layers
    ruled = sliding_window_defaults(model.config, block_size)
    if ruled is not None:
        return ruled
    digest = model_digest(source) if num_layers >= MIN_LAYERS else None
    if digest is None:
        why = f"fewer than {MIN_LAYERS} layers" if num_layers < MIN_LAYERS else "no model file to key a calibration by"
        return Calibration(tuple(range(num_layers)), HEAVY_BLOCKS[0] * block_size, f"every layer: {why}")
    path = cache_path(digest, model.dtype, block_size)
    cached = read_cached(path)
    if cached is not None:
        return cached
    logger.info("calibrating the replay defaults of %s (once per model: %d planted facts)", source, CASES)
    result = calibrate(model, tokenizer, block_size, prefill_kernel)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({k: v for k, v in asdict(result).items() if k != "source"}))
        temporary.replace(path)
    except OSError as error:  # a read-only home: the pass runs again next time
        logger.warning("could not cache the calibration in %s: %s", path, error)
    return result


def calibrate(model, tokenizer, block_size: int, prefill_kernel=None, cases: int = CASES,
              seed: int = 0) -> Calibration:
    """Run the planted-fact cases and choose the detector's layers, its threshold and the heavy
    budget."""
    from pydoc_data.topics import topics
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    corpus = encode("\n\n".join(topics[key] for key in sorted(topics))[:200_000])
    rng = random.Random(seed)
    planted, ordinary, ranks = [], [], []
    for case in range(cases):
        name, value = NAMES[case % len(NAMES)], str(rng.randrange(10_000, 100_000))
        needle = encode(f"\nThe secret number of {name} is {value}.\n")
        question = encode(f"\n\nQuestion: What is the secret number of {name}?\n"
                          f"Answer: The secret number of {name} is")
        digits = encode(f" {value}")[:OBSERVED - 1]
        hay_tokens = CASE_TOKENS - len(needle) - len(question) - len(digits)
        offset = rng.randrange(len(corpus) - hay_tokens)
        hay = corpus[offset:offset + hay_tokens]
        at = int(len(hay) * rng.uniform(0.15, 0.45))
        tokens = hay[:at] + needle + hay[at:] + question + digits
        needle_blocks = range(at // block_size, (at + len(needle) - 1) // block_size + 1)
        ordinary_end = at + len(needle) + int(0.6 * (len(hay) - at))
        question_end = len(tokens) - len(digits)
        layers = _observe(model, tokens, block_size, (ordinary_end, question_end, len(tokens)),
                          prefill_kernel)
        at_ordinary, at_question, at_answer = layers
        middle = [b for b in range(1, (ordinary_end - WINDOW_TOKENS) // block_size) if b not in needle_blocks]
        planted.append(at_answer[:, list(needle_blocks)].amax(-1))                  # [L]
        ordinary.append(at_ordinary[:, middle].amax(-1))                           # [L]
        importance = at_question.sum(0)  # the engine's score: summed over layers
        candidates = [b for b in range(1, (question_end - WINDOW_TOKENS) // block_size)]
        order = sorted(candidates, key=lambda b: (-float(importance[b]), b))
        ranks.append(min(order.index(b) for b in needle_blocks if b in order))
    planted, ordinary = torch.stack(planted), torch.stack(ordinary)  # [cases, L]
    planted_mean, ordinary_mean = planted.mean(0), ordinary.mean(0)
    count = math.ceil(model.config.num_layers / MIN_LAYERS)
    chosen = torch.argsort(planted_mean - ordinary_mean, descending=True, stable=True)[:count]
    heavy_blocks = min(max(max(ranks) + 1, HEAVY_BLOCKS[0]), HEAVY_BLOCKS[1])
    layers = tuple(sorted(int(i) for i in chosen))
    rounded = lambda values: tuple(round(float(v), 4) for v in values)  # noqa: E731
    planted_low, ordinary_high = rounded(planted.amin(0)), rounded(ordinary.amax(0))
    return Calibration(layers, heavy_blocks * block_size, "calibrated", rounded(planted_mean),
                       rounded(ordinary_mean), planted_low, ordinary_high,
                       choose_threshold(planted_low, ordinary_high, layers))


@torch.inference_mode()
def _observe(model, tokens: list[int], block_size: int, ends: tuple[int, ...],
             prefill_kernel=None) -> list[torch.Tensor]:
    """Prefill `tokens` in chunks ending at `ends`, observing each chunk's last OBSERVED queries
    in every layer: one [layers, blocks] tensor of block mass per end."""
    cfg, device = model.config, model.device
    num_blocks = -(-len(tokens) // block_size)
    kv = KVManager(num_blocks, block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype, device)
    table = torch.arange(num_blocks, dtype=torch.long)
    observed, start = [], 0
    for end in ends:
        positions = torch.arange(start, end)
        slots = table[positions // block_size] * block_size + positions % block_size
        mask = None if start == 0 else (torch.arange(end)[None, :] <= positions[:, None]).to(device)
        chunk = PrefillSlice(0, end - start, end, table[:-(-end // block_size)].to(device), mask,
                             observe=OBSERVED, causal_from=start, layer_masses=[])
        model.forward(torch.tensor(tokens[start:end], device=device), positions.to(device), kv.kv_caches,
                      AttentionMetadata(slot_mapping=slots.to(device), prefills=[chunk],
                                        prefill_kernel=prefill_kernel),
                      torch.tensor([end - start - 1], dtype=torch.long, device=device))
        observed.append(torch.stack([m.float().cpu() for m in chunk.layer_masses]))
        start = end
    return observed


def index_share(model_config, layers, block_size: int, dtype_bytes: int = 2) -> float:
    """The key index's bytes for one dropped block when the detector reads `layers` (None: every
    layer a dropped block leaves), against the block's K and V in the layers that keep it."""
    local = local_layers_of(model_config)
    stored = model_config.num_layers - len(local)
    read = stored if layers is None else len(layers)
    heads, dim = model_config.num_kv_heads, model_config.head_dim
    return KeyIndex.bytes_per_slot(read, heads, block_size, dim) / (2 * stored * heads * dim * block_size * dtype_bytes)


def index_crowds_budget(model_config, layers, block_size: int, ratio: float | None,
                        dtype_bytes: int = 2) -> str | None:
    """Why `auto` reads no layer under `resident_ratio` `ratio` (the key index of `layers` would
    take more than INDEX_BUDGET of it), or None when it fits or no ratio is set."""
    if ratio is None:
        return None
    share = index_share(model_config, layers, block_size, dtype_bytes)
    if (1 - ratio) * share <= INDEX_BUDGET * ratio:
        return None
    return (f"the key index of need_layers {'all' if layers is None else format_layers(layers)} "
            f"({100 * share:.2f}% of each dropped block) would take more than {100 * INDEX_BUDGET:g}% "
            f"of resident_ratio {ratio:g}: no need detector, dropped ranges come back when a prefill needs them")


def replay_knobs(config, model, tokenizer, source: str
                 ) -> tuple[frozenset[int] | None, int, float, Calibration | None]:
    """The need detector's layers (None: all) and threshold, and the heavy-hitter budget in
    tokens for this engine: the configured values, with "auto" resolved by the model's
    calibration for the policies that replay on need (need_layers, replay_threshold: otherwise
    unused; heavy_tokens: otherwise 0). An auto threshold follows the layers read, calibrated or
    configured."""
    from kvreplay.config import AUTO
    from kvreplay.kernels import cpu_kernels
    replays = config.kv_policy.replays_on_need
    layers, heavy, threshold = config.need_layer_set, config.heavy_tokens, config.replay_threshold
    calibration = None
    if replays and AUTO in (layers, heavy, threshold):
        kernel = cpu_kernels.prefill_attention() \
            if model.device.type == "cpu" and model.dtype == torch.bfloat16 else None
        calibration = calibrated_defaults(model, tokenizer, source, config.block_size, kernel)
        logger.info("replay knobs for this model: %s", calibration.describe())
    if layers == AUTO:
        layers = frozenset(calibration.need_layers) if calibration else None
        crowded = replays and index_crowds_budget(model.config, layers, config.block_size, config.resident_ratio,
                                                  torch.finfo(model.dtype).bits // 8)
        if crowded:
            logger.info("need_layers=none: %s", crowded)
            layers = frozenset()
    local = local_layers_of(model.config)
    if replays and local and layers is None:  # "all": every layer a dropped block leaves, the global ones
        layers = frozenset(i for i in range(model.config.num_layers) if i not in local)
    if heavy == AUTO:
        heavy = calibration.heavy_tokens if calibration else 0
    if threshold == AUTO:
        threshold = THRESHOLD_FALLBACK if calibration is None or layers == frozenset() else \
            calibration.threshold_for(range(model.config.num_layers) if layers is None else layers)
    return layers, heavy, threshold, calibration

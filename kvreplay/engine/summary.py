"""What a loaded engine is, in a few lines for the startup log (as vLLM prints its KV blocks and
concurrency): the model, the KV pool in blocks, tokens and bytes per token, how many requests of
the full context it holds at once, the KV policy with the knobs it uses, and the threads and
compiled kernels the steps run on. `kvreplay serve`, `generate` and `chat` show it at startup."""
from __future__ import annotations

import os

import torch

from kvreplay.engine.calibration import format_layers
from kvreplay.kernels import cpu_kernels
from kvreplay.planner import format_bytes


def describe(engine, load_seconds: float | None = None) -> list[str]:
    """The startup summary of `engine` (an LLMEngine), one string per line."""
    config, model_config, kv = engine.config, engine.model_config, engine.kv
    ready = f"ready in {load_seconds:.1f} s: " if load_seconds is not None else ""
    context = engine.max_model_len
    blocks_per_request = -(-context // kv.block_size)
    blocks_per_request += kv.local.num_groups * min(blocks_per_request, kv.local.window_blocks)  # hybrid
    lines = [
        f"{ready}{os.path.basename(engine.model_source.rstrip('/'))} ({model_config.architecture}, "
        f"{model_config.num_layers} layers, {model_config.num_kv_heads} KV heads x "
        f"{model_config.head_dim}), {str(config.torch_dtype).removeprefix('torch.')} on "
        f"{config.device}, context {context:,} tokens",
        f"KV cache: {format_bytes(kv.num_blocks * kv.block_bytes)} = {kv.num_blocks:,} blocks x "
        f"{kv.block_size} tokens = {kv.capacity_tokens:,} tokens, {engine.kv_bytes_per_token:,} "
        f"bytes per token; max concurrency at {context:,} tokens per request: "
        f"{kv.num_blocks / blocks_per_request:.2f}x",
        f"policy {config.policy}: {', '.join(policy_knobs(engine))}",
        f"steps: {config.max_num_batched_tokens} tokens, {config.max_num_seqs} sequences at most; "
        f"{compute(engine)}",
    ]
    if kv.local.num_groups:
        lines.insert(2, f"hybrid pool: a block of {len(kv.storages)} layers ({kv.block_bytes:,} bytes); "
                        f"{kv.local.num_groups} local layer groups keep their last {kv.local.window_blocks} blocks")
    tier = kv.tier_io.tier if kv.tier_io is not None else None
    if tier is not None:
        where = f", disk {format_bytes(tier.disk_budget)} in {tier.directory}" if tier.directory else ""
        lines.append(f"session tier: memory {format_bytes(tier.memory_budget)}{where}, "
                     f"choice {config.kv_tier_choice}")
    return lines


def policy_knobs(engine) -> list[str]:
    """The knobs the engine's policy reads, with the values it runs with (calibrated ones
    resolved)."""
    config, policy = engine.config, engine.config.kv_policy
    marks = config.watermark_levels
    knobs = [f"watermarks {marks.low:g}/{marks.admit:g}/{marks.high:g}",
             f"pause {config.pause_mode}",
             f"prefix caching {'on' if config.enable_prefix_caching else 'off'}",
             f"sinks {config.sink_tokens}"]
    if config.resident_ratio is not None:
        knobs.append(f"resident_ratio {config.resident_ratio:g}")
    if policy.name == "full":
        return knobs
    if policy.recent_tokens is not None:
        knobs.append(f"recent {policy.recent_tokens} token{'s' if policy.recent_tokens != 1 else ''}")
    elif config.resident_ratio is not None and policy.recent_share is not None:
        knobs.append("window sized by resident_ratio")
    else:
        knobs.append(f"window {config.window_tokens}")
    if policy.drops_middle and policy.trims_under_pressure:
        knobs.append(f"trim {config.trim}, order {config.trim_order}, importance pool "
                     f"{engine.scheduler.reclaim.importance_pool}")
    if policy.replays_on_need and not engine.runner.detect_need:
        knobs.append(f"need_layers none (no need detector: dropped ranges come back when a prefill needs them), "
                     f"heavy_tokens {engine.scheduler.reclaim.heavy_blocks * config.block_size}")
    elif policy.replays_on_need:
        layers = engine.runner.need_layers
        knobs.append(f"replay_threshold {engine.scheduler.replay.threshold:g}, need_layers "
                     f"{'all' if layers is None else format_layers(layers)}, heavy_tokens "
                     f"{engine.scheduler.reclaim.heavy_blocks * config.block_size}")
        if engine.calibration is not None:
            knobs.append(f"calibration {engine.calibration.source}")
    if policy.demotes:
        knobs.append(f"cold {config.cold_dtype}, sparse_budget {config.sparse_budget or 'all'}, "
                     f"hot_turns {config.hot_turns}")
    return knobs


def compute(engine) -> str:
    """Threads and the compiled kernels in use."""
    if engine.config.device != "cpu":
        graphs = ", CUDA graphs" if engine.runner.graphs is not None else ""
        return f"device {engine.config.device} (PyTorch ops{graphs})"
    kernels = [name.replace("_", " ") for name in cpu_kernels.loaded()]
    if any(engine.model.fused_rows):
        kernels.append("fused decode layers")
    used = ", ".join(kernels) if kernels else "none (the PyTorch path)"
    return f"{torch.get_num_threads()} threads; compiled CPU kernels: {used}"


"""The engine's model: which class runs it, the settings it cannot serve, refused before the
weights load, and the KV pool sized for it (docs/architecture.md, "Gemma 3")."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvreplay.config import EngineConfig
from kvreplay.kv import KVManager
from kvreplay.models.config import ModelConfig
from kvreplay.models.gemma3 import Gemma3Model
from kvreplay.models.llama import LlamaModel
from kvreplay.models.loader import load_model, read_model_config

# architecture -> the class that runs it (the rest are the Llama family)
MODEL_CLASSES = {"gemma3": Gemma3Model}


@dataclass
class EngineModel:
    model: LlamaModel | Gemma3Model
    tokenizer: object  # a transformers tokenizer
    source: str        # the model file or directory
    max_model_len: int


def check_model_settings(config: EngineConfig, model_config: ModelConfig) -> int:
    """The engine's context (max_model_len, default the model's); ValueError for settings this
    model cannot serve (a sliding-window model's: `check_sliding_window`)."""
    context = model_config.max_position_embeddings
    max_model_len = config.max_model_len or context
    if max_model_len > context:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context ({context} "
                         f"tokens): lower it to {context} or less")
    if model_config.sliding_window is not None:
        check_sliding_window(config, model_config)
    return max_model_len


def check_sliding_window(config: EngineConfig, model_config: ModelConfig) -> None:
    """A sliding-window model's lossy policies act on its global layers only, through the hybrid
    pool (its local layers keep their own window, read by position: engine/local_meta.py)."""
    policy, name = config.kv_policy, model_config.architecture
    if policy.name == "full":
        return
    if not hybrid(config, model_config):
        raise ValueError(f"policy={config.policy!r} on {name} needs hybrid_kv=True: with every layer keeping "
                         "every block, its sliding-window layers would read the global table by position, "
                         "which a dropped or cold block shifts, and take Quest's selection meant for the "
                         "global layers; set hybrid_kv=True or use policy='full'")
    named = config.need_layer_set  # replay: the detector reads keys a dropped block leaves, global ones
    local = sorted(set(named) & set(model_config.local_layers)) if isinstance(named, frozenset) else []
    if policy.keeps_key_index and local:
        raise ValueError(f"need_layers={config.need_layers!r} names sliding-window layers of {name} "
                         f"({', '.join(map(str, local))}): they keep no dropped block; name global layers "
                         "or leave it auto")
    if config.layered_prefill:
        raise ValueError(f"layered_prefill is not supported for {name}: its layer-at-a-time pass has one "
                         "RoPE and one table for every layer; turn it off")


def load_engine_model(config: EngineConfig) -> EngineModel:
    """Check the settings against the model's header, then load its weights into its class."""
    max_model_len = check_model_settings(config, read_model_config(config.model))
    loaded = load_model(config.model, config.chat_template)
    model_class = MODEL_CLASSES.get(loaded.config.architecture, LlamaModel)
    model = model_class(loaded.config, loaded.weights, config.torch_dtype, config.device, loaded.quantized)
    return EngineModel(model, loaded.tokenizer, loaded.source, max_model_len)


def hybrid(config: EngineConfig, model_config: ModelConfig) -> bool:
    """The pool is hybrid (kv/local_groups.py): a sliding-window model, `hybrid_kv` on."""
    return bool(config.hybrid_kv and model_config.sliding_window and model_config.local_layers)


def build_kv_manager(config: EngineConfig, model_config: ModelConfig, need_layers) -> KVManager:
    """The KV manager with as many blocks as `kv_cache_memory` holds. A hybrid pool's block
    (page) holds one block of the global layers or of one group of as many local layers."""
    local_layers = model_config.local_layers if hybrid(config, model_config) else ()
    num_global = model_config.num_layers - len(local_layers)
    dtype_bytes = torch.finfo(config.torch_dtype).bits // 8
    block_bytes = 2 * num_global * model_config.num_kv_heads * model_config.head_dim * dtype_bytes * config.block_size
    num_blocks = config.kv_cache_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={config.kv_cache_memory!r} holds no block of {config.block_size} "
                         f"tokens ({block_bytes:,} bytes): raise it")
    return KVManager(num_blocks, config.block_size, model_config.num_layers, model_config.num_kv_heads,
                     model_config.head_dim, config.torch_dtype, config.device,
                     enable_prefix_caching=config.enable_prefix_caching,
                     cold_dtype=config.cold_dtype if config.kv_policy.demotes else None,
                     index_layers=need_layers, local_layers=local_layers,
                     sliding_window=model_config.sliding_window if local_layers else None)

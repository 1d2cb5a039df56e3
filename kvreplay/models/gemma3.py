"""Gemma 3 (text): the second model family, sliding-window and global layers in one stack.

What differs from the Llama family (models/llama.py), all of it read from the GGUF metadata
(models/config.py) and described in docs/architecture.md, "Gemma 3":
- embeddings scaled by sqrt(hidden); a tied LM head;
- RMSNorm before and after attention and before and after the MLP (four a layer), and on each
  q and k head; llama.cpp's files store Gemma's norm weights as 1 + w, so x * weight here is
  transformers' x * (1 + w);
- a GeGLU MLP: down(gelu_tanh(gate) * up);
- local layers attend to their last `sliding_window` positions with RoPE base
  `rope_local_theta`; every global one attends to everything with base `rope_theta`.

The cache is the engine's: every layer keeps every block, or under the hybrid pool
(kv/local_groups.py) local layers keep their window's blocks only, in pages their group's table
names (`meta.for_layer`). Local layers go through the PyTorch path with a window
(layers/window.py); global layers' decode rows take the compiled decode kernel where the runner
hands it over. No fused decode layer: decode_layer is Llama's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvreplay.layers.attention import AttentionMetadata, paged_attention
from kvreplay.layers.linear import Projection, QuantizedWeight
from kvreplay.models.config import ModelConfig
from kvreplay.models.llama import rotate_half, tensor_taker


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' Gemma3RMSNorm rounds it: normalise and scale in fp32, then cast."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope_frequencies(theta: float, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies, in transformers' arithmetic (default RoPE)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


class Gemma3Model:
    """The model's forward over a flat batch, with LlamaModel's interface (forward, embed, logits,
    layer) so the engine's runner, layered pass and benches take either."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 quantized: dict[str, QuantizedWeight] | None = None):
        """`weights`: transformers' Gemma 3 names with llama.cpp's 1 + w norms (models/loader.py);
        `quantized`: the GGUF blocks the tied head may read (layers/linear.py)."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        take = tensor_taker(weights, self.device, dtype)

        self.embed_tokens = take("model.embed_tokens.weight")  # [V, hidden]
        # transformers rounds sqrt(hidden) to the model dtype before scaling
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype)
        self.norm = take("model.norm.weight")
        if "lm_head.weight" in weights and not config.tie_word_embeddings:
            self.lm_head = Projection(take("lm_head.weight"))
        else:
            self.lm_head = Projection(self.embed_tokens,
                                      quantized=(quantized or {}).get("model.embed_tokens.weight"))
        self.layers = [self._layer(take, f"model.layers.{i}.") for i in range(config.num_layers)]
        self.windows = [config.layer_window(i) for i in range(config.num_layers)]
        self.rope_kinds = ["global" if window is None else "local" for window in self.windows]
        local_theta = config.rope_local_theta or config.rope_theta
        self.inv_freq = {"global": rope_frequencies(config.rope_theta, config.head_dim).to(self.device),
                         "local": rope_frequencies(local_theta, config.head_dim).to(self.device)}
        # LlamaModel's attention scale: Gemma 3's query_pre_attn_scalar is the head size
        self.scale = config.head_dim ** -0.5
        self.fused_rows = [0] * config.num_layers  # no fused decode layer (engine/summary.py reads it)

    @staticmethod
    def _layer(take, prefix: str) -> dict:
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        return {
            "input_norm": take(prefix + "input_layernorm.weight"),
            "post_attention_norm": take(prefix + "post_attention_layernorm.weight"),
            "pre_mlp_norm": take(prefix + "pre_feedforward_layernorm.weight"),
            "post_mlp_norm": take(prefix + "post_feedforward_layernorm.weight"),
            "q_norm": take(attn + "q_norm.weight"),
            "k_norm": take(attn + "k_norm.weight"),
            # fused projections: one matmul for q, k, v and one for gate, up
            "qkv": Projection(torch.cat([take(attn + "q_proj.weight"), take(attn + "k_proj.weight"),
                                         take(attn + "v_proj.weight")])),
            "o": Projection(take(attn + "o_proj.weight")),
            "gate_up": Projection(torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])),
            "down": Projection(take(mlp + "down_proj.weight")),
        }

    def restack(self) -> None:
        """Nothing to rebuild: there is no fused decode stack (LlamaModel's interface)."""

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, logit_indices: torch.Tensor | None, greedy: bool = False) -> torch.Tensor:
        """One step over a flat batch (as LlamaModel.forward): [len(logit_indices), vocab] float32
        logits, or with `greedy` the rows' argmax tokens."""
        rope = {kind: self.rope(positions, kind) for kind in self.inv_freq}
        hidden = self.embed(input_ids)  # [T, hidden]
        for index, kv_cache in enumerate(kv_caches):
            cos, sin = rope[self.rope_kinds[index]]
            delta, hidden = self.layer(index, hidden, None, cos, sin, kv_cache, meta.for_layer(index))
            hidden = hidden + delta
        if logit_indices is not None:
            hidden = hidden[logit_indices]
        if greedy:
            return self.lm_head.argmax(self.final_norm(hidden.contiguous(), None))
        return self.logits(hidden.contiguous(), None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens) * self.embed_scale

    def rope(self, positions: torch.Tensor, kind: str = "global") -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] in the model dtype for `positions`: global or local layers' (`kind`),
        computed as transformers does (fp32 products, then cos and sin)."""
        freqs = positions.float()[:, None] * self.inv_freq[kind][None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def final_norm(self, delta: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        hidden = delta if residual is None else residual + delta
        return gemma_rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def logits(self, delta: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Final norm and LM head: [T, vocab] float32 logits."""
        return self.lm_head.float_output(self.final_norm(delta, residual))

    def layer(self, index: int, delta: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
              sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer `index`: (delta, residual) in and out as in LlamaModel.layer (the layer's
        input is residual + delta). `cos`, `sin` must be this layer's kind (see `rope`; the
        layered pass hands global ones, which is why it is refused for this model).
        Writes the tokens' K/V into `kv_cache` at `meta.slot_mapping`."""
        cfg, layer = self.config, self.layers[index]
        eps, head_dim = cfg.rms_norm_eps, cfg.head_dim
        num_q, num_kv = cfg.num_heads, cfg.num_kv_heads
        hidden = delta if residual is None else residual + delta  # [T, hidden]
        num_tokens = hidden.shape[0]
        qkv = layer["qkv"](gemma_rms_norm(hidden, layer["input_norm"], eps))  # [T, (Hq + 2 Hkv) D]
        q = gemma_rms_norm(qkv[:, :num_q * head_dim].view(num_tokens, num_q, head_dim), layer["q_norm"], eps)
        k = gemma_rms_norm(qkv[:, num_q * head_dim:(num_q + num_kv) * head_dim].view(num_tokens, num_kv, head_dim),
                           layer["k_norm"], eps)
        v = qkv[:, (num_q + num_kv) * head_dim:].reshape(num_tokens, num_kv, head_dim)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]  # [T, Hq, D]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]  # [T, Hkv, D]
        attn = paged_attention(q, k, v, kv_cache, meta, self.scale, window=self.windows[index])
        attn = layer["o"](attn.reshape(num_tokens, num_q * head_dim))
        hidden = hidden + gemma_rms_norm(attn, layer["post_attention_norm"], eps)
        gate, up = layer["gate_up"](gemma_rms_norm(hidden, layer["pre_mlp_norm"], eps)).chunk(2, dim=-1)
        mlp = layer["down"](F.gelu(gate, approximate="tanh") * up)
        return gemma_rms_norm(mlp, layer["post_mlp_norm"], eps), hidden


"""The Llama family (Llama 2/3, Mistral, SmolLM, Qwen2 with q/k/v biases, Qwen3 with q/k norms).

Plain tensors and `torch.nn.functional`; the device and dtype follow the weights. Attention is
delegated to `kvreplay.layers.attention.paged_attention`, which reads and writes the paged KV cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvreplay.kernels import cpu_kernels
from kvreplay.layers.attention import AttentionMetadata, add_decode_mass, paged_attention
from kvreplay.models.config import ModelConfig
from kvreplay.layers.linear import Projection, QuantizedWeight, onto_huge_pages, silu_pair_order
from kvreplay.kernels.switches import switch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as transformers: normalise in fp32, cast back, then scale.
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of residual + x, residual + x); x itself when there is no residual yet."""
    hidden = x if residual is None else residual + x
    return rms_norm(hidden, weight, eps), hidden


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def tensor_taker(weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
    """name -> that checkpoint tensor on `device` in `dtype`, contiguous; a missing one is a
    ValueError naming it."""
    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise ValueError(f"checkpoint lacks tensor {name}")
        return weights[name].to(device=device, dtype=dtype).contiguous()
    return take


def fused_decode_enabled() -> bool:
    """KVREPLAY_FUSED_DECODE=0 runs decode steps through the Python layer code (for comparisons
    and debugging); 1 or unset: through decode_layer where it applies."""
    return switch("KVREPLAY_FUSED_DECODE")


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 quantized: dict[str, QuantizedWeight] | None = None):
        """`quantized`: the GGUF blocks some of `weights` were dequantized from (the loader's);
        the decode products read those where they can (linear.py)."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        take = tensor_taker(weights, self.device, dtype)

        def blocks(*names: str) -> QuantizedWeight | None:
            return QuantizedWeight.concat([(quantized or {}).get(name) for name in names])

        self.embed_tokens = take("model.embed_tokens.weight")  # [V, hidden]
        self.norm = take("model.norm.weight")
        # A tied head is packed into its own copy: the embedding lookup needs the plain matrix.
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = Projection(self.embed_tokens if tied else take("lm_head.weight"),
                                  quantized=blocks("model.embed_tokens.weight" if tied else "lm_head.weight"))
        self.layers = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            attn, mlp = prefix + "self_attn.", prefix + "mlp."
            bias = None
            if config.attention_bias:
                bias = torch.cat([take(attn + "q_proj.bias"), take(attn + "k_proj.bias"),
                                  take(attn + "v_proj.bias")])
            layer = {
                "input_norm": take(prefix + "input_layernorm.weight"),
                "post_norm": take(prefix + "post_attention_layernorm.weight"),
                # Fused projections: one matmul instead of three (q, k, v) and two (gate, up).
                "qkv": Projection(torch.cat([take(attn + "q_proj.weight"), take(attn + "k_proj.weight"),
                                             take(attn + "v_proj.weight")]), bias,
                                  quantized=blocks(attn + "q_proj.weight", attn + "k_proj.weight",
                                                   attn + "v_proj.weight")),
                "o": Projection(take(attn + "o_proj.weight"), quantized=blocks(attn + "o_proj.weight")),
                # its panel copy in pair order: the panel kernel gives SiLU x up (panel_silu_mul)
                "gate_up": Projection(torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]),
                                      quantized=blocks(mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                                      panel_order=silu_pair_order(config.intermediate_size)),
                "down": Projection(take(mlp + "down_proj.weight"), quantized=blocks(mlp + "down_proj.weight")),
                "q_norm": None, "k_norm": None,
            }
            if config.qk_norm:
                layer["q_norm"] = take(attn + "q_norm.weight")
                layer["k_norm"] = take(attn + "k_norm.weight")
            self.layers.append(layer)
        # every decode step streams all panel copies: one buffer on 2 MiB pages (1.06-1.13x the
        # products here, docs/benchmarks.md)
        onto_huge_pages([self.lm_head] + [layer[name] for layer in self.layers
                                          for name in ("qkv", "o", "gate_up", "down")])

        head_dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                                .float() / head_dim))
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        self.rope_cos = emb.cos().to(self.device)
        self.rope_sin = emb.sin().to(self.device)
        self.scale = head_dim ** -0.5
        # On CPU the layer glue (residual add + RMSNorm, RoPE + cache write, SiLU x up) runs as compiled
        # single ops (kvreplay/kernels/csrc/layer_ops.cpp) where they build; else plain PyTorch.
        self.layer_ops = cpu_kernels.layer_ops() if self.device.type == "cpu" else None
        # A decode-only step runs each layer as one compiled op (decode_layer: the same ops in
        # the same order, without the Python between them) up to this many rows; 0: never.
        self.decode_attention_op = cpu_kernels.decode_attention() if self.layer_ops is not None else None
        fused = fused_decode_enabled()
        self.fused_rows = [self._fused_rows(layer) if fused else 0 for layer in self.layers]
        self.restack()

    def restack(self) -> None:
        """Build decode_layers' arguments for the whole stack (6 weights and 4 biases a layer)
        from the projections' panels: once at load, and again by whoever replaces a projection's
        `panels` (the benches that compare two forms of them)."""
        self._stack_weights, self._stack_biases = [], []
        if any(self.fused_rows):
            for layer in self.layers:
                projections = [layer[name] for name in ("qkv", "o", "gate_up", "down")]
                self._stack_weights += [layer["input_norm"], layer["post_norm"]] + [p.panels for p in projections]
                self._stack_biases += [p.panel_bias for p in projections]

    def _fused_rows(self, layer: dict) -> int:
        """Most rows layer `layer` takes through decode_layer: every projection must go to the
        panel kernel at that count (else 0)."""
        if self.decode_attention_op is None or not hasattr(self.layer_ops, "decode_layer") \
                or self.dtype != torch.bfloat16 or layer["q_norm"] is not None:
            return 0
        projections = [layer[name] for name in ("qkv", "o", "gate_up", "down")]
        if any(p.panel_linear is None for p in projections) or layer["gate_up"].panel_order is None:
            return 0
        return min(p.panel_rows for p in projections)

    def _fused_step(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step may run layers through decode_layer: decode rows only, through the
        compiled attention kernel as it is (no wrapper). The need detector's layers still go
        through `layer` (see forward)."""
        return (self.layer_ops is not None and meta.decode_kernel is not None
                and meta.decode_kernel is self.decode_attention_op
                and meta.num_decode_tokens == num_tokens and not meta.prefills)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, logit_indices: torch.Tensor | None, greedy: bool = False) -> torch.Tensor:
        """Run one step over a flat batch of tokens.

        Args:
            input_ids: [T] token ids of every scheduled token, all sequences concatenated.
            positions: [T] absolute positions.
            kv_caches: per layer, [2, num_kv_heads, num_blocks, block_size, head_dim].
            meta: where each token's K/V goes and what each query attends to.
            logit_indices: rows of the batch whose logits are wanted (None: all).
            greedy: return each wanted row's argmax token instead of its logits.
        Returns:
            [len(logit_indices), vocab] float32 logits, or with `greedy` [len(logit_indices)]
            int64 token ids (`logits.argmax(-1)`, computed without storing the logits).
        """
        cos, sin = self.rope(positions)
        # The residual stream is carried as (residual, delta): each norm adds the last sublayer's
        # output in the same pass, as transformers' `residual + sublayer(x)` does.
        delta, residual = self.embed(input_ids), None  # [T, hidden]
        num_tokens = input_ids.shape[0]
        fused = self._fused_step(meta, num_tokens)
        if fused and meta.probe is None and num_tokens <= min(self.fused_rows):
            delta, residual = self.decode_layers(delta, cos, sin, kv_caches, meta)
        else:
            for index, kv_cache in enumerate(kv_caches):
                if fused and num_tokens <= self.fused_rows[index] and (meta.probe is None or meta.probe.skip_layer()):
                    delta, residual = self.decode_layer(index, delta, residual, cos, sin, kv_cache, meta)
                else:
                    delta, residual = self.layer(index, delta, residual, cos, sin, kv_cache, meta)
        if logit_indices is not None:
            delta, residual = delta[logit_indices], residual[logit_indices]
        if greedy:
            return self.lm_head.argmax(self.final_norm(delta.contiguous(), residual.contiguous()))
        return self.logits(delta.contiguous(), residual.contiguous())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] in the model dtype for `positions`."""
        return (self.rope_cos.index_select(0, positions).to(self.dtype),
                self.rope_sin.index_select(0, positions).to(self.dtype))

    def final_norm(self, delta: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The residual stream's rows after the last layer, normed: the LM head's input."""
        norm = self.layer_ops.add_rms_norm if self.layer_ops is not None else add_rms_norm
        return norm(delta, residual, self.norm, self.config.rms_norm_eps)[0]

    def logits(self, delta: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Final norm and LM head: [T, vocab] float32 logits of the residual stream's rows."""
        return self.lm_head.float_output(self.final_norm(delta, residual))

    def decode_layer(self, index: int, delta: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                     sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer` for a decode-only step in one compiled call (see `_fused_step`)."""
        layer, cfg = self.layers[index], self.config
        qkv, o, gate_up, down = layer["qkv"], layer["o"], layer["gate_up"], layer["down"]
        delta, residual, mass = self.layer_ops.decode_layer(
            delta, residual, layer["input_norm"], layer["post_norm"], cfg.rms_norm_eps,
            qkv.panels, qkv.panel_bias, o.panels, o.panel_bias, gate_up.panels, gate_up.panel_bias,
            down.panels, down.panel_bias, cos, sin, cfg.num_heads, cfg.num_kv_heads, kv_cache, meta.slot_mapping,
            meta.decode_block_tables, meta.decode_context, self.scale, meta.observe_decode)
        if meta.observe_decode:
            add_decode_mass(meta, mass)
        return delta, residual

    def decode_layers(self, delta: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor],
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer through `decode_layer` in one compiled call (decode_layers: no Python
        between the layers, one set of buffers for all of them); the residual stream starts here."""
        cfg = self.config
        delta, residual, masses = self.layer_ops.decode_layers(
            delta, None, self._stack_weights, self._stack_biases, cfg.rms_norm_eps, cos, sin,
            cfg.num_heads, cfg.num_kv_heads, kv_caches, meta.slot_mapping, meta.decode_block_tables,
            meta.decode_context, self.scale, meta.observe_decode)
        for mass in masses:
            add_decode_mass(meta, mass)
        return delta, residual

    def layer(self, index: int, delta: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
              sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer `index` over a flat batch: (delta, residual) in, (delta, residual) out.
        Writes the tokens' K/V into `kv_cache` at `meta.slot_mapping`."""
        cfg = self.config
        layer = self.layers[index]
        num_q, num_kv, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = num_q * head_dim, num_kv * head_dim
        eps = cfg.rms_norm_eps
        ops = self.layer_ops
        norm = ops.add_rms_norm if ops is not None else add_rms_norm
        num_tokens = delta.shape[0]
        x, residual = norm(delta, residual, layer["input_norm"], eps)
        qkv = layer["qkv"](x)  # [T, q_size + 2 kv_size]
        if layer["q_norm"] is not None:
            qk = qkv[:, :q_size + kv_size].view(num_tokens, num_q + num_kv, head_dim)
            qkv[:, :q_size + kv_size] = torch.cat(
                [rms_norm(qk[:, :num_q], layer["q_norm"], eps),
                 rms_norm(qk[:, num_q:], layer["k_norm"], eps)], dim=1).view(num_tokens, -1)
        if ops is not None:  # rotates q and k in place and writes k, v into the cache
            ops.rope_write_cache(qkv, cos, sin, num_q, num_kv, kv_cache, meta.slot_mapping)
        qk = qkv[:, :q_size + kv_size].view(num_tokens, num_q + num_kv, head_dim)
        if ops is None:
            qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]  # q and k heads in one pass
        q, k = qk[:, :num_q], qk[:, num_q:]
        v = qkv[:, q_size + kv_size:].view(num_tokens, num_kv, head_dim)
        attn = paged_attention(q, k, v, kv_cache, meta, self.scale,
                               cache_written=ops is not None)  # [T, num_q, D]
        delta = layer["o"](attn.reshape(num_tokens, q_size))
        x, residual = norm(delta, residual, layer["post_norm"], eps)
        gate_up = layer["gate_up"]
        if ops is not None and gate_up.panel_order is not None and gate_up.on_panels(x):
            delta = layer["down"](ops.panel_silu_mul(x, gate_up.panels, gate_up.panel_bias))
        elif ops is not None:
            delta = layer["down"](ops.silu_mul(gate_up(x)))
        else:
            gate, up = layer["gate_up"](x).chunk(2, dim=-1)
            delta = layer["down"](F.silu(gate) * up)
        return delta, residual

"""KV quantization primitives: the dropped blocks' key index, the cold tier, and the Quest bound.

- Key index (`quantize_keys_int4`): a dropped block keeps only its keys, as int4 per channel over
  the block's tokens (KIVI-style: key outliers sit in a few channels, so a per-channel range keeps
  every other channel precise). Its per-channel min/max double as the block's Quest summaries.
- Cold tier (`quantize` / `dequantize`): whole blocks as int8, fp8 (e4m3) or group-wise int4.
- `block_upper_bound`: Quest's bound of each block's largest attention logit, for ranking blocks.

Math runs in fp32 whatever the input dtype; only storage is narrow. Everything batches over
leading dims, so a caller passes e.g. [num_blocks, num_kv_heads, block_tokens, head_dim] at once.
Stored fp16 minima are rounded down and maxima/scales up, so a stored range always covers the data:
the round-trip error stays within half a step and the Quest bound stays a true upper bound.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

KINDS = ("int8", "fp8", "int4")
AXES = ("token", "channel")
INT4_GROUP = 32  # channels sharing one int4 min/scale in the cold tier
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# int8/fp8 scales are fp32: inputs may be bf16, whose range fp16 scales cannot cover, and at one
# scale per head_dim values the extra 2 bytes over fp16 are 3% of a 64-dim int8 token.
_SYMMETRIC_SCALE_BYTES = 4
_INT4_PARAM_BYTES = 2 + 2  # fp16 min + fp16 scale per group


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _half_down(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the largest fp16 not above x."""
    h = x.half()
    return torch.where(h.float() > x, torch.nextafter(h, h.new_tensor(float("-inf"))), h)


def _half_up(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the smallest fp16 not below x."""
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, h.new_tensor(float("inf"))), h)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Packs 4-bit codes two per byte along the last dim: even index low nibble, odd index high.

    Args:
        codes: uint8 [..., D] with values in [0, 15] (not checked: this is on the hot path).

    Returns:
        uint8 [..., D // 2].
    """
    assert codes.dtype == torch.uint8, f"pack_int4 takes uint8 codes, got {codes.dtype}"
    assert codes.shape[-1] % 2 == 0, f"pack_int4 needs an even last dim, got {codes.shape[-1]}"
    return codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., D//2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [..., D // 2] -> uint8 codes [..., D]."""
    assert packed.dtype == torch.uint8, f"unpack_int4 takes uint8, got {packed.dtype}"
    pairs = torch.stack((packed & 0xF, packed >> 4), dim=-1)  # [..., D//2, 2]
    return pairs.flatten(-2)  # [..., D]


def _int4_codes(x: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round((x - lo) / scale) clamped to [0, 15]; a zero scale (constant range) gives code 0."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((x - lo) / safe).round_().clamp_(0, 15).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Key index


@dataclass
class KeyCodes:
    """A block's keys as per-channel int4; `lo`/`hi` are also its Quest min/max summaries."""

    packed: torch.Tensor  # uint8 [..., T, D//2]
    lo: torch.Tensor  # fp16 [..., 1, D], per-channel min over T (rounded down)
    hi: torch.Tensor  # fp16 [..., 1, D], per-channel max over T (rounded up)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed) + _nbytes(self.lo) + _nbytes(self.hi)


def quantize_keys_int4(keys: torch.Tensor) -> KeyCodes:
    """Quantizes keys to int4 per channel over the token axis.

    Args:
        keys: [..., T, D] float keys of one or more blocks (T = block tokens, D even).

    Returns:
        KeyCodes; each element dequantizes within (hi - lo) / 30 of its input.

    Raises:
        ValueError: if D is odd (codes are packed two per byte).
    """
    if keys.shape[-1] % 2:
        raise ValueError(f"int4 keys pack two channels per byte; head_dim={keys.shape[-1]} is odd")
    x = keys.float()  # [..., T, D]
    lo = _half_down(x.amin(dim=-2, keepdim=True))  # [..., 1, D]
    hi = _half_up(x.amax(dim=-2, keepdim=True))  # [..., 1, D]
    # Quantize against the stored fp16 range so that dequantization sees the same grid.
    scale = (hi.float() - lo.float()) / 15  # [..., 1, D]
    return KeyCodes(pack_int4(_int4_codes(x, lo.float(), scale)), lo, hi)


def dequantize_keys_int4(codes: KeyCodes, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """KeyCodes -> keys [..., T, D] in `dtype`, every value within [lo, hi]."""
    weight = unpack_int4(codes.packed).float() / 15  # [..., T, D]
    # lerp returns lo at code 0 and hi at code 15 exactly, so values never leave the summary range.
    return torch.lerp(codes.lo.float(), codes.hi.float(), weight).to(dtype)  # [..., T, D]


# ---------------------------------------------------------------------------------------------
# Cold tier


@dataclass
class QTensor:
    """A quantized [..., T, D] tensor of the cold tier.

    Scale shapes: int8/fp8 [..., T, 1] (axis="token") or [..., 1, D] (axis="channel");
    int4 [..., T, D//32, 1] (axis="token", groups of 32 channels) or [..., 1, D] (axis="channel").
    """

    data: torch.Tensor  # int8 / float8_e4m3fn [..., T, D], or uint8 [..., T, D//2] for int4
    scale: torch.Tensor  # fp32 (int8, fp8) or fp16 (int4), shaped as above
    zero: torch.Tensor | None  # int4 only: fp16 group minimum, shaped like scale
    kind: str
    axis: str
    shape: torch.Size  # the original [..., T, D]
    dtype: torch.dtype  # the original dtype, dequantize()'s default

    @property
    def nbytes(self) -> int:
        return _nbytes(self.data) + _nbytes(self.scale) + _nbytes(self.zero)


@lru_cache(maxsize=None)
def fp8_supported(device_type: str = "cpu") -> bool:
    """Whether this torch build can cast to and from float8_e4m3fn on `device_type`."""
    try:
        torch.ones(2, device=device_type).to(torch.float8_e4m3fn).float()
        return True
    except (RuntimeError, TypeError, AttributeError):
        return False


def _check(kind: str, axis: str, head_dim: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown cold-tier kind {kind!r}; choose one of {', '.join(KINDS)}")
    if axis not in AXES:
        raise ValueError(f"unknown quantization axis {axis!r}; choose one of {', '.join(AXES)}")
    if kind == "int4" and axis == "token" and head_dim % INT4_GROUP:
        raise ValueError(f"int4 groups {INT4_GROUP} channels; head_dim={head_dim} is not a "
                         f"multiple of {INT4_GROUP}: use int8/fp8 or axis='channel'")
    if kind == "int4" and head_dim % 2:
        raise ValueError(f"int4 packs two channels per byte; head_dim={head_dim} is odd")


def quantize(x: torch.Tensor, kind: str, axis: str = "token") -> QTensor:
    """Quantizes a block (or a batch of blocks) for the cold tier.

    Args:
        x: [..., T, D] float tensor.
        kind: "int8" (symmetric), "fp8" (e4m3, absmax scaled to 448) or "int4" (asymmetric).
        axis: "token" scales each token over D (int4: per group of 32 channels); "channel"
            scales each channel over T (KIVI-style keys).

    Returns:
        QTensor. Error bounds: int8 scale/2; int4 scale/2 (scale = group range / 15);
        fp8 2^-4 of |x| plus 2^-10 of the scale (e4m3 has 3 mantissa bits).

    Raises:
        ValueError: unknown kind or axis, or a head_dim int4 cannot group or pack.
        NotImplementedError: fp8 on a device where this torch cannot cast to float8_e4m3fn.
    """
    assert x.dim() >= 2, f"quantize takes [..., T, D], got shape {tuple(x.shape)}"
    head_dim = x.shape[-1]
    _check(kind, axis, head_dim)
    if kind == "fp8" and not fp8_supported(x.device.type):
        raise NotImplementedError(f"torch {torch.__version__} cannot cast to float8_e4m3fn on "
                                  f"{x.device.type}; use cold_dtype='int8'")
    xf = x.float()  # [..., T, D]
    reduce_dim = -1 if axis == "token" else -2
    if kind == "int4":
        if axis == "token":
            xf = xf.unflatten(-1, (head_dim // INT4_GROUP, INT4_GROUP))  # [..., T, G, 32]
        lo = _half_down(xf.amin(dim=reduce_dim, keepdim=True))  # [..., T, G, 1] or [..., 1, D]
        hi = xf.amax(dim=reduce_dim, keepdim=True)
        # Scale rounded up so lo + 15 * scale still reaches the max: no clamping error.
        scale = _half_up((hi - lo.float()) / 15)
        codes = _int4_codes(xf, lo.float(), scale.float()).reshape(x.shape)  # [..., T, D]
        return QTensor(pack_int4(codes), scale, lo, kind, axis, x.shape, x.dtype)
    qmax = 127.0 if kind == "int8" else FP8_MAX
    scale = xf.abs().amax(dim=reduce_dim, keepdim=True) / qmax  # [..., T, 1] or [..., 1, D]
    scaled = (xf / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(-qmax, qmax)
    data = scaled.round_().to(torch.int8) if kind == "int8" else scaled.to(torch.float8_e4m3fn)
    return QTensor(data, scale, None, kind, axis, x.shape, x.dtype)


def dequantize(q: QTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """QTensor -> [..., T, D] in `dtype` (default: the dtype it was quantized from)."""
    dtype = q.dtype if dtype is None else dtype
    if q.kind != "int4":
        return (q.data.float() * q.scale).to(dtype)  # [..., T, D]
    codes = unpack_int4(q.data).float()  # [..., T, D]
    if q.axis == "token":
        codes = codes.unflatten(-1, (q.shape[-1] // INT4_GROUP, INT4_GROUP))  # [..., T, G, 32]
    return (q.zero.float() + codes * q.scale.float()).reshape(q.shape).to(dtype)


def bytes_per_token(kind: str, head_dim: int, axis: str = "token", block_tokens: int = 16) -> float:
    """Cold-tier bytes per token per KV head (K or V alone): data plus amortised scales.

    Args:
        kind: "int8", "fp8" or "int4".
        head_dim: channels per head.
        axis: as in `quantize`; "channel" spreads one scale row over `block_tokens` tokens.
        block_tokens: tokens per block, used only for axis="channel".
    """
    _check(kind, axis, head_dim)
    data_bytes = head_dim / 2 if kind == "int4" else head_dim
    if axis == "channel":
        per_channel = _INT4_PARAM_BYTES if kind == "int4" else _SYMMETRIC_SCALE_BYTES
        return data_bytes + per_channel * head_dim / block_tokens
    if kind == "int4":
        return data_bytes + _INT4_PARAM_BYTES * head_dim // INT4_GROUP
    return data_bytes + _SYMMETRIC_SCALE_BYTES


# ---------------------------------------------------------------------------------------------
# Quest bound


def block_upper_bound(query: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Upper bound of each block's largest attention logit, sum_d max(q_d * lo_d, q_d * hi_d).

    Args:
        query: [..., G, D] queries (e.g. the G query heads sharing a KV head).
        lo: [..., N, D] per-block per-channel key minima.
        hi: [..., N, D] per-block per-channel key maxima. Leading dims batch as in torch.matmul.

    Returns:
        [..., G, N] bounds, in the promoted dtype of query and summaries (bf16 with fp16 -> fp32).
    """
    dtype = torch.promote_types(query.dtype, lo.dtype)
    q = query.to(dtype)  # [..., G, D]
    # With hi >= lo the max picks q*hi where q > 0 and q*lo where q < 0, so two matmuls give the
    # bound without a [..., G, N, D] intermediate.
    return q.clamp(min=0) @ hi.to(dtype).mT + q.clamp(max=0) @ lo.to(dtype).mT  # [..., G, N]

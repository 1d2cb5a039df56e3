"""Which attention backend an engine takes, and the Triton kernels, loaded only when asked for.

`attention_backend` (an EngineConfig knob): "torch" keeps PyTorch's ops (and the compiled CPU
kernels); "triton" runs decode attention, prefill attention over cached blocks, the Quest bound and
the need detector's block scores through the Triton kernels of triton_attention.py and
triton_sparse.py; "auto" is triton on a CUDA device when the triton package imports, else torch.

Triton is optional: nothing here imports it until `kernels()` is called, so the package imports
without it. On a CPU the kernels run only through Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported), which is how the tests check them on machines without a GPU.
"""
from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

BACKENDS = ("auto", "torch", "triton")
TRITON_PIN = "triton==3.9.0"  # the version the Makefile installs (--no-deps) and the tests ran with


def triton_available() -> bool:
    """Whether the triton package is installed (found, not imported)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether TRITON_INTERPRET=1: Triton kernels run on CPU tensors through its interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(backend: str, device_type: str) -> bool:
    """Whether an engine on `device_type` ("cpu" or "cuda") runs the Triton kernels under
    `backend`. A ValueError when "triton" is asked for and cannot run: triton is not installed,
    or the device is a CPU and TRITON_INTERPRET=1 is not set."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":
        return device_type == "cuda" and triton_available()
    if not triton_available():
        raise ValueError(f"attention_backend='triton' needs the triton package, which is not installed "
                         f"(pip install --no-deps {TRITON_PIN}); use attention_backend='torch'")
    if device_type != "cuda" and not interpreting():
        raise ValueError("attention_backend='triton' on a CPU runs only through Triton's interpreter: "
                         "set TRITON_INTERPRET=1 in the environment, or use attention_backend='torch'")
    return True


def kernels() -> SimpleNamespace:
    """The Triton kernels' entry points (imports triton on first call):

    - decode_attention(q, key_cache, value_cache, block_tables, context, scale, want_lse,
      want_mass) -> (out, lse, mass): the compiled CPU decode kernel's signature;
    - prefill_attention(q, key_cache, value_cache, block_table, context, causal_from, scale);
    - quest_bound(query, lo, hi, slot_table, valid) -> [R, Hkv, N];
    - decode_block_mass(q, key_cache, block_tables, context, lse, scale) -> [B, Hkv, W];
    - cold_attention(query, fields, kind, slots, valid) -> (out, lse, block_lse);
    - need_block_lse(query, codes, lo, hi, slots) -> [R, Hkv, G, k].
    """
    from kvreplay.kernels import triton_attention, triton_sparse
    return SimpleNamespace(decode_attention=triton_attention.decode_attention,
                           decode_block_mass=triton_attention.decode_block_mass,
                           prefill_attention=triton_attention.prefill_attention,
                           quest_bound=triton_sparse.quest_bound,
                           cold_attention=triton_sparse.cold_attention,
                           need_block_lse=triton_sparse.need_block_lse)

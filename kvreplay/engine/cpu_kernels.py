"""Compiled CPU kernels, built once per machine with the local C++ compiler, optional.

`decode_attention()` returns `torch.ops.kvreplay_cpu.decode_attention` (csrc/decode_attention.cpp)
or None, in which case attention.py keeps its pure PyTorch path (same results within rounding:
the kernel accumulates in fp32 where the PyTorch path rounds scores and probabilities to the
model dtype). The build takes ~30 s the first time and is cached under torch's extension
directory (~/.cache/torch_extensions), keyed by the source's hash.

Set KVREPLAY_CPU_KERNELS=0 to skip it (no compiler, or to compare against the PyTorch path).
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
_lock = threading.Lock()
_state: dict[str, object] = {}


def enabled() -> bool:
    return os.environ.get("KVREPLAY_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def decode_attention() -> Callable | None:
    """The compiled decode-attention op, building it on first call; None when disabled or when
    the build fails (logged once)."""
    if not enabled():
        return None
    with _lock:
        if "op" not in _state:
            _state["op"] = _build()
        return _state["op"]  # type: ignore[return-value]


def _is_built(name: str) -> bool:
    try:
        from torch.utils.cpp_extension import _get_build_directory
        return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()
    except Exception:  # a private helper of torch: if it moves, just announce the build
        return False


def _build() -> Callable | None:
    if hasattr(torch.ops, "kvreplay_cpu") and hasattr(torch.ops.kvreplay_cpu, "decode_attention"):
        return torch.ops.kvreplay_cpu.decode_attention  # loaded already in this process
    try:
        from torch.utils.cpp_extension import load_inline
        source = SOURCE.read_text()
        name = f"kvreplay_cpu_{hashlib.sha256(source.encode()).hexdigest()[:10]}"
        if not _is_built(name):  # a silent half-minute pause would look like a hang
            print("kvreplay: compiling the CPU decode-attention kernel (first use on this machine, "
                  "~30 s; KVREPLAY_CPU_KERNELS=0 skips it)", file=sys.stderr, flush=True)
        load_inline(name=name, cpp_sources=[source], is_python_module=False,
                    extra_cflags=["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"],
                    extra_ldflags=["-fopenmp"])
        return torch.ops.kvreplay_cpu.decode_attention
    except Exception as exc:  # no compiler, no ninja, an odd platform: the PyTorch path works
        log.warning("CPU decode-attention kernel unavailable (%s: %s); using the PyTorch path",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None

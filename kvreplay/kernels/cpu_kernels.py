"""Compiled CPU kernels, built once per machine with the local C++ compiler, optional.

Two extensions, each returned as a namespace of torch ops or None (then the caller keeps its
pure PyTorch path, which stays the reference):

- `decode_attention()`: `torch.ops.kvreplay_cpu.decode_attention` (csrc/decode_attention.cpp,
  which registers the extension's ops; block steps in csrc/attention.h), paged decode attention.
  Same results within rounding: the kernel accumulates in fp32 where the PyTorch path rounds
  scores and probabilities to the model dtype. From the same extension: `prefill_attention()`
  (csrc/prefill_attention.cpp) and `need_block_mass()` (csrc/need_detector.cpp), the need
  detector's reading of the key index (KeyIndex.max_block_mass).
- `layer_ops()`: `torch.ops.kvreplay_layer` (csrc/layer_ops.cpp registers the ops; declarations
  shared by its sources in csrc/layer_ops.h): the decoder layer's glue (residual add + RMSNorm,
  RoPE + cache write, SiLU x up: csrc/layer_glue.cpp) as single ops with PyTorch's arithmetic,
  the panel products (csrc/panels.cpp, with the kernels of csrc/panel_avx512.cpp,
  csrc/panel_avx2.cpp and csrc/int_products.cpp), GGUF blocks as panels
  (csrc/quant_blocks.cpp), argmax_rows (csrc/argmax.cpp) and the fused decoder layers
  (csrc/decode_layers.cpp).

Each extension is its list of sources built together (one .so). A build takes ~30-60 s the
first time and is cached under torch's extension directory (~/.cache/torch_extensions), keyed by
the hash of the extension's sources and headers (csrc/simd.h and its own), the build flags and
the CPU (model and instruction-set flags: the builds use -march=native).
Set KVREPLAY_CPU_KERNELS=0 to skip both (no compiler, or to compare against the PyTorch path).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvreplay.kernels.switches import check_kernel_switches, flag

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# name -> (sources built together (the first registers the ops), headers they include, torch.ops
# namespace it registers, one of its ops, compiler flags); paths relative to csrc/
_EXTENSIONS = {
    "decode_attention": (["decode_attention.cpp", "prefill_attention.cpp", "need_detector.cpp"],
                         ["simd.h", "attention.h"], "kvreplay_cpu", "decode_attention",
                         ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]),
    # no fast-math, no FMA contraction: its ops round exactly where PyTorch does
    "layer_ops": (["layer_ops.cpp", "layer_glue.cpp", "panels.cpp", "panel_avx512.cpp", "panel_avx2.cpp",
                   "quant_blocks.cpp", "int_products.cpp", "argmax.cpp", "decode_layers.cpp"],
                  ["simd.h", "layer_ops.h"], "kvreplay_layer", "add_rms_norm",
                  ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]),
}
_lock = threading.Lock()
_state: dict[str, Any] = {}
_SLOW_LOAD_S = 2.0  # a load taking longer than this was a build


def enabled() -> bool:
    """KVREPLAY_CPU_KERNELS: unset, 1, true, yes or on builds and uses the kernels; 0, false, no or
    off keeps the PyTorch path; anything else is a ValueError (switches.flag)."""
    return flag("KVREPLAY_CPU_KERNELS")


def should_build() -> bool:
    """Enabled, and a C++ compiler and ninja are on the PATH: then a failed build is a bug."""
    return enabled() and shutil.which("c++") is not None and shutil.which("ninja") is not None


def decode_attention() -> Any | None:
    """The compiled decode-attention op, building it on first call; None when disabled or when
    the build fails (logged once)."""
    ops = _load("decode_attention")
    return None if ops is None else ops.decode_attention


def need_block_mass() -> Any | None:
    """The need detector's compiled scoring of dropped blocks (same extension), or None."""
    ops = _load("decode_attention")
    return None if ops is None else ops.need_block_mass


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags (Linux's /proc/cpuinfo, read once; empty where unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_amx_bf16() -> bool:
    """Whether this CPU has AMX bf16 tiles (False where unknown)."""
    return "amx_bf16" in cpu_flags()


def has_avx512_bf16() -> bool:
    """Whether this CPU has AVX512-BF16 pair dot products (False where unknown); without them the
    layer ops' panel kernel is the AVX2 one (fp32 FMAs on widened weights)."""
    return "avx512_bf16" in cpu_flags()


def prefill_attention(only_where_faster: bool = True) -> Any | None:
    """Causal attention of a bf16 prompt chunk over its resident earlier positions and itself
    (same extension), or None where it does not build or the CPU lacks AVX512-BF16. Also None on
    a CPU with AMX tiles unless `only_where_faster` is False (tests, bench/prefill_attention.py):
    there PyTorch's scaled_dot_product_attention runs on the tiles, 2-4x faster than this
    kernel's vector code (128-2,048 tokens, docs/benchmarks.md)."""
    if only_where_faster and has_amx_bf16():
        return None
    ops = _load("decode_attention")
    return ops.prefill_causal if ops is not None and ops.has_prefill_causal() else None


def layer_ops() -> Any | None:
    """`torch.ops.kvreplay_layer` (add_rms_norm, rope_write_cache), or None as above."""
    return _load("layer_ops")


def loaded() -> list[str]:
    """The extensions built and loaded in this process so far (for the startup summary)."""
    with _lock:
        return [name for name, ops in _state.items() if ops is not None]


def _load(name: str) -> Any | None:
    if not enabled():
        return None
    check_kernel_switches()  # the C++ reads them as "0" or on: a typo would pass silently there
    with _lock:
        if name not in _state:
            _state[name] = _build(name)
        return _state[name]


def _cpu_signature() -> str:
    """The CPU model and instruction-set flags (Linux /proc/cpuinfo), else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().split("\n\n", 1)[0].splitlines()  # the first processor
        wanted = ("vendor_id", "model name", "flags", "Features", "CPU part")
        return "\n".join(line for line in lines if line.split(":", 1)[0].strip() in wanted)
    except OSError:
        import platform
        return f"{platform.machine()} {platform.processor()}"


def _is_built(name: str) -> bool:
    try:
        from torch.utils.cpp_extension import _get_build_directory
        return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()
    except Exception:  # a private helper of torch: if it moves, just announce the build
        return False


def build_name(name: str) -> str:
    """The cached build's module name: the extension's name and a hash of everything the build
    depends on. -march=native builds for this CPU, so a home directory shared by machines with
    other CPUs must not load it there: the CPU is part of the key. The checkout's path is not
    (a fresh clone reuses the build), so two checkouts used at once (git worktrees) should each
    set their own TORCH_EXTENSIONS_DIR: torch's build files name the sources by path, and a
    shared folder is rebuilt each time the other checkout loads."""
    sources, headers, _, _, flags = _EXTENSIONS[name]
    text = "".join(f"{filename}\n{(CSRC / filename).read_text()}" for filename in [*sources, *headers])
    key = text + " ".join(flags) + _cpu_signature()
    return f"kvreplay_{name}_{hashlib.sha256(key.encode()).hexdigest()[:10]}"


@contextlib.contextmanager
def _build_lock(module: str):
    """Serialise builds of `module` across processes with a lock the OS drops when its holder
    dies, and clear torch's own `lock` file under it. torch waits forever on that file, and a
    build killed midway (a timeout, ^C) leaves it behind: every later start would hang. Holding
    this lock, no live kvreplay build owns that file. Yields the build directory."""
    from torch.utils.cpp_extension import _get_build_directory
    build_dir = Path(_get_build_directory(module, verbose=False))
    with open(build_dir.parent / f"{module}.kvreplay-lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            baton = build_dir / "lock"
            if baton.exists():
                log.warning("removing a stale kernel build lock left by a stopped build: %s", baton)
                baton.unlink(missing_ok=True)
            yield build_dir
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(name: str) -> Any | None:
    sources, _, namespace, op, flags = _EXTENSIONS[name]
    if hasattr(getattr(torch.ops, namespace), op):
        return getattr(torch.ops, namespace)  # loaded already in this process
    try:
        from torch.utils.cpp_extension import load
        module = build_name(name)
        label = f"the CPU {name.replace('_', ' ')} kernel"
        announced = not _is_built(module)
        if announced:  # a silent half-minute pause would look like a hang
            print(f"kvreplay: compiling {label} (first use on this machine, ~30-60 s; "
                  "KVREPLAY_CPU_KERNELS=0 skips it)", file=sys.stderr, flush=True)
        started = time.perf_counter()
        with _build_lock(module):
            load(name=module, sources=[str(CSRC / filename) for filename in sources], is_python_module=False,
                 extra_cflags=flags, extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)])
        elapsed = time.perf_counter() - started
        # A cached build loads in well under a second; longer means torch compiled it (also
        # unannounced: another checkout's build in the same folder, see build_name)
        if announced or elapsed > _SLOW_LOAD_S:
            print(f"kvreplay: {label} {'compiled' if announced else 'built or loaded'} in "
                  f"{elapsed:.1f} s", file=sys.stderr, flush=True)
        else:
            log.debug("%s loaded from its cached build in %.2f s", label, elapsed)
        return getattr(torch.ops, namespace)
    except Exception as exc:  # no compiler, no ninja, an odd platform: the PyTorch path works
        log.warning("CPU %s kernel unavailable (%s: %s); using the PyTorch path", name,
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None

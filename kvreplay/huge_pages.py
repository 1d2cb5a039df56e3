"""Large CPU buffers on 2 MiB pages (Linux transparent huge pages, asked for per buffer).

Decode attention reads a batch's K/V as 2 KiB blocks scattered over the pool, and a decode step
streams every projection's panel copy (models/linear.py): on 4 KiB pages nearly every block read
is another page, so another TLB miss and page walk, and the hardware prefetchers stop at each
page's end. Where the kernel's transparent huge pages are in `madvise`
mode (common: /sys/kernel/mm/transparent_hugepage/enabled), a buffer gets 2 MiB pages only when
asked for before it is first touched. `empty` asks (madvise MADV_HUGEPAGE over the buffer's
2 MiB-aligned inside) and returns it untouched; the caller fills it. Nothing changes where the
kernel says no, off Linux, on other devices, or with KVREPLAY_HUGE_PAGES=0.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux") or os.environ.get("KVREPLAY_HUGE_PAGES") == "0":
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise(tensor: torch.Tensor) -> bool:
    """Ask for 2 MiB pages under the whole 2 MiB pages inside `tensor`'s bytes (CPU only); True
    when the kernel took the advice. Pages already touched stay as they are until the kernel's
    background thread merges them, so call this before the first write."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return False
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    start = -(-begin // _HUGE_PAGE) * _HUGE_PAGE
    stop = end // _HUGE_PAGE * _HUGE_PAGE
    return stop > start and madvise(start, stop - start, _MADV_HUGEPAGE) == 0


def empty(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.empty, on 2 MiB pages where the machine gives them; untouched (the first write places it)."""
    tensor = torch.empty(*shape, dtype=dtype, device=device)
    advise(tensor)
    return tensor


def zeros(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros, on 2 MiB pages where the machine gives them (see the module docstring)."""
    tensor = torch.empty(*shape, dtype=dtype, device=device)
    advise(tensor)
    return tensor.zero_()

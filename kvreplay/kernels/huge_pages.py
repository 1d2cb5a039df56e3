"""Large CPU buffers on 2 MiB pages (Linux transparent huge pages, asked for per buffer).

Decode attention reads a batch's K/V as 2 KiB blocks scattered over the pool, and a decode step
streams every projection's panel copy (models/linear.py): on 4 KiB pages nearly every block read
is another page, so another TLB miss and page walk, and the hardware prefetchers stop at each
page's end. Where the kernel's transparent huge pages are in `madvise` mode (common: see
/sys/kernel/mm/transparent_hugepage/enabled), memory gets 2 MiB pages only when asked for before
it is first touched, so `empty` maps fresh memory itself (a buffer from the allocator may be
memory it had already touched), asks (madvise MADV_HUGEPAGE) and returns it untouched: the
caller's first write places it. The tensor keeps the mapping alive; it is unmapped with the
tensor. Plain torch.empty where the kernel says no, off Linux, on other devices, for buffers
under 2 MiB, or with KVREPLAY_HUGE_PAGES=0.
"""
from __future__ import annotations

import math
import mmap
import sys

import torch

from kvreplay.kernels.switches import switch

HUGE_PAGE = 2 << 20


def enabled() -> bool:
    return switch("KVREPLAY_HUGE_PAGES") and sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def empty(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.empty(*shape), on 2 MiB pages where the machine gives them (module docstring)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or not enabled():
        return torch.empty(*shape, dtype=dtype, device=device)
    # anonymous and private (a shared mapping would be shmem, which has its own huge page switch),
    # page-aligned, untouched
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)  # whole pages inside
    except OSError:  # the kernel says no (transparent huge pages off): 4 KiB pages then
        pass
    return raw[offset:offset + nbytes].view(dtype).view(shape)


def zeros(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(*shape), on 2 MiB pages where the machine gives them."""
    return empty(*shape, dtype=dtype, device=device).zero_()

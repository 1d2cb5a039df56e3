"""The server process's C allocator (glibc's malloc on Linux; elsewhere these do nothing).

The engine thread allocates and frees each step's buffers, whose sizes change with the batch,
and the session tier's thread block-sized copies. glibc gives each thread an arena of its own and
keeps freed space mapped: a server's resident memory grew ~1.5 MiB per request without bound
(bench/soak.py; docs/benchmarks.md, "Reliability"). One arena for every thread stops most of it;
returning the free pages every few hundred steps stops the rest.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

_M_ARENA_MAX = -8  # mallopt's parameter number in glibc
_libc = None


def _glibc():
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c") if platform.libc_ver()[0] == "glibc" else None
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    return _libc or None


def use_one_arena() -> bool:
    """Serve every thread from one malloc arena. Call before the threads start; True if done."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_ARENA_MAX, 1))


def release_free_memory() -> None:
    """Give the heap's free pages back to the OS (malloc_trim): milliseconds, between steps."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)

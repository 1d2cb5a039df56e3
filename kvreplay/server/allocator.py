"""The server process's C allocator (glibc's malloc on Linux; elsewhere these do nothing).

The engine thread allocates and frees each step's buffers, whose sizes change with the batch.
glibc gives each thread an arena of its own and keeps freed space mapped: 224 requests, 4 at a
time, grew a server's resident memory by ~1.5 MiB each; with one arena for every thread the same
run stayed flat, and returning free pages (malloc_trim) gives back ~400 MiB the start-up leaves.
What the soak still grew by was oneDNN's memory per shape (layers/linear.py `onednn_rows`).
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

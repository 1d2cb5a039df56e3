"""Shared by the tests of the compiled CPU kernels (kvreplay/engine/cpu_kernels.py)."""
import pytest

from kvreplay.engine import cpu_kernels


def built_or_skip(built, what: str):
    """`built` when the kernel built; a skip where no toolchain exists; a failure where one does
    (then the build broke, see the log)."""
    if built is None:
        assert not cpu_kernels.should_build(), \
            f"the {what} failed to build although a compiler and ninja exist (see the log)"
        pytest.skip(f"no C++ toolchain here: the PyTorch path replaces the {what}")
    return built

"""Shared by the tests of the compiled CPU kernels (kvreplay/kernels/cpu_kernels.py)."""
import contextlib
import os
import subprocess
import sys

import pytest
import torch

from kvreplay.kernels import cpu_kernels


def built_or_skip(built, what: str):
    """`built` when the kernel built; a skip where no toolchain exists; a failure where one does
    (then the build broke, see the log)."""
    if built is None:
        assert not cpu_kernels.should_build(), \
            f"the {what} failed to build although a compiler and ninja exist (see the log)"
        pytest.skip(f"no C++ toolchain here: the PyTorch path replaces the {what}")
    return built


def run_with_switch(tmp_path, switch: str, source: str) -> subprocess.CompletedProcess:
    """Run `source` in a fresh interpreter with the environment variable `switch` set to 0 (the
    kernels read their tile switches once per process) and tests/ on its path; it must exit 0."""
    script = tmp_path / "switched_off.py"
    script.write_text(f"import sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n" + source)
    result = subprocess.run([sys.executable, str(script)], env={**os.environ, switch: "0"}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's (and the kernels') thread count set to n inside: `make test`'s workers run one
    thread each, so tests of what several threads share set the count they mean."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

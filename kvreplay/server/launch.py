"""`kvreplay serve` as a child process on a loopback port: start it, wait until /health answers,
stop it. What `make run` (kvreplay/demo.py), the benchmarks that need a real server and the
server tests share."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


class ServerStartError(RuntimeError):
    """The server exited, or did not answer /health in time."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(args: list[str], port: int, log=None, env: dict | None = None) -> subprocess.Popen:
    """`python -m kvreplay serve --port PORT ARGS...`, its output into the file `log` (a pipe
    could fill up and block the server), or this process's own output when None."""
    return subprocess.Popen([sys.executable, "-m", "kvreplay", "serve", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT if log is not None else None, env=env)


def wait_healthy(process: subprocess.Popen, base_url: str, timeout_s: float, poll_s: float = 0.3) -> float:
    """Seconds until GET /health answered 200; ServerStartError if the process exits first
    or `timeout_s` passes."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            raise ServerStartError(f"the server exited with status {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except (OSError, urllib.error.URLError):  # not listening yet, or 503 while it starts
            pass
        time.sleep(poll_s)
    raise ServerStartError(f"the server was not healthy after {timeout_s:.0f} s")


def stop(process: subprocess.Popen, timeout_s: float = 30.0, already_signalled: bool = False) -> int:
    """SIGTERM (unless the process had its signal already, as after a Ctrl-C), then SIGKILL
    if it has not exited within `timeout_s`. Returns the exit status."""
    nudges = [None] if already_signalled else []
    for nudge in [*nudges, process.terminate, process.kill]:
        if process.poll() is not None:
            return process.returncode
        if nudge is not None:
            nudge()
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            continue
    return process.wait()

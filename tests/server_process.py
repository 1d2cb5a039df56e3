"""A real `kvreplay serve` process on a free loopback port, for the server tests."""
from __future__ import annotations

import os
import tempfile
import time

import httpx

from kvreplay.server import launch

STARTUP_TIMEOUT_S = 180.0


class ServerProcess:
    """`python -m kvreplay serve --dtype float32 ...`; output goes to a temp file (a pipe could
    fill up and block the server), shown when a test needs it via `log()`."""

    def __init__(self, *extra_args: str, kv_cache_memory: str = "64MiB", api_key: str | None = None):
        self.port = launch.free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self._log = tempfile.NamedTemporaryFile("w+", prefix="kvreplay-serve-", suffix=".log")
        env = dict(os.environ, KVREPLAY_API_KEY=api_key or "")
        if not api_key:
            env.pop("KVREPLAY_API_KEY")
        self.process = launch.spawn(["--dtype", "float32", "--kv-cache-memory", kv_cache_memory, *extra_args],
                                    self.port, self._log, env)

    def log(self) -> str:
        self._log.flush()
        with open(self._log.name) as handle:
            return handle.read()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_healthy(self) -> None:
        try:
            launch.wait_healthy(self.process, self.base_url, STARTUP_TIMEOUT_S)
        except launch.ServerStartError as exc:
            self.stop()
            raise RuntimeError(f"{exc}:\n{self.log()}") from None

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time. Returns the exit status."""
        return launch.stop(self.process, timeout_s)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.base_url + path, headers=self.headers, timeout=30, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        kwargs.setdefault("headers", self.headers)
        kwargs.setdefault("timeout", 60)
        return httpx.post(self.base_url + path, **kwargs)

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics, e.g. metric('kvreplay_requests_total', 'endpoint="...",...')."""
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_kv_clean(self, timeout_s: float = 30.0) -> dict:
        """Poll /debug/kv until no request holds blocks; the engine checks integrity each time."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.get("/debug/kv").json()
            assert state["integrity"] == "ok", state
            if state["num_used_blocks"] == 0 and state["num_requests"] == 0 \
                    and state["num_queued_seqs"] == 0:
                return state
            assert time.monotonic() < deadline, f"KV pool not clean after {timeout_s} s: {state}"
            time.sleep(0.2)


def serving(*extra_args: str, check_exit: bool = True, **kwargs):
    """The body of a server fixture: a healthy ServerProcess, stopped afterwards (its exit
    status asserted 0 unless `check_exit` is False). Use as `yield from serving(...)`."""
    proc = ServerProcess(*extra_args, **kwargs)
    try:
        proc.wait_healthy()
        yield proc
    finally:
        status = proc.stop()
        if check_exit:
            assert status == 0, proc.log()

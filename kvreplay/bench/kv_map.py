"""`bench serve --kv-map`: the KV map (engine/kv_map.py) recorded during a run, a few states a
second, for the console's page to replay afterwards (server/console.py `snapshot_page`).

In-process, `KVMapRecorder.record` runs after each engine step on the bench's own thread (the
engine's owner there); against a server, `poll_server` reads its `/v1/kv/state` from a thread.
"""
from __future__ import annotations

import json
import threading
import urllib.request

from kvreplay.engine.kv_map import kv_state

INTERVAL_S = 0.25    # the live console's poll
MAX_STATES = 2400    # 10 minutes at INTERVAL_S: later states thin out the recording


class KVMapRecorder:
    """States of one run, at most one per `interval_s` of the bench's clock (and the last)."""

    def __init__(self, interval_s: float = INTERVAL_S, max_states: int = MAX_STATES):
        self.interval_s = interval_s
        self.max_states = max_states
        self.states: list[dict] = []
        self.finished_totals: dict[str, int] = {}
        self._last = -float("inf")

    def record(self, engine, outputs, now: float, force: bool = False) -> None:
        """After a step: count the requests that ended, and draw the map when it is time."""
        for output in outputs:
            if output.finished:
                for completion in output.outputs:
                    for name, value in completion.stats.as_dict().items():
                        self.finished_totals[name] = self.finished_totals.get(name, 0) + value
        if force and self.states and self.states[-1]["step"] == engine.counters.steps:
            return  # this step is drawn already
        if force or now - self._last >= self.interval_s:
            self._last = now
            self.states.append(kv_state(engine, now, self.finished_totals))
            if len(self.states) > self.max_states:  # keep every other state, and the last
                self.states = self.states[::2] + ([self.states[-1]] if len(self.states) % 2 == 0 else [])
                self.interval_s *= 2


def poll_server(base_url: str, states: list[dict], stop: threading.Event,
                interval_s: float = INTERVAL_S, timeout_s: float = 5.0) -> None:
    """Append the server's `/v1/kv/state` to `states` every `interval_s` until `stop` is set;
    a failed read is skipped (the run's own errors are reported by its requests)."""
    url, first = base_url.rstrip("/") + "/v1/kv/state", True
    while not stop.wait(0 if first else interval_s):
        first = False
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                states.append(json.load(response))
        except (OSError, ValueError):
            continue

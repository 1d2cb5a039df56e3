"""A server soak (issue 40): a mixed workload for a fixed time against a real `kvreplay serve`,
with a kill -9 and a restart in the middle.

The server runs the replay policy under a tight KV budget (`--kv-cache-memory`), with the session
tier on disk (`--kv-tier-dir`, a fresh temporary directory) so that a kill can land while block
files are written, and `--debug-endpoints` for the pool's integrity check at the end.
`--clients` closed-loop clients send, each drawing from one seeded stream:

- prompts of the serving mix's lengths (docs/architecture.md §8, scaled by `--length-scale`),
  slices of the Python docs, as chat or completions, streamed or not (half each), `--output-tokens`
  each; a third of the chats resend their conversation with one more turn (prefix hits, tier loads);
- `--disconnect` of the requests stream and hang up after their second chunk;
- `--bad` of the requests are malformed (bad JSON, bad fields, unknown model, a prompt over the
  context): each must get a 4xx;
- every `--burst-every` seconds, `--max-queued-seqs` + 16 short requests at once: those over the
  queue get 429, which must carry Retry-After.

At `--kill-at` (a share of `--duration`; 0 for none) the server gets SIGKILL; it is restarted with
the same flags and directory at once and the clients go on. Requests that fail while it is down
are counted apart ("killed"). Reported: requests by outcome and status, p50/p99 latency of the
served ones, the process's resident memory (VmRSS) after warm-up and at the end of each life
(and the medians of its readings over the first and last RSS_WINDOW_S),
seconds from start to healthy for both starts, temporary files the killed process left and
whether the restart removed them, the tier's discarded torn files, and the `/debug/kv` integrity
check at the end. A 5xx, a transport error while the server is up, or a 4xx on a good request
other than 429 is an error; the exit status is 1 when there is any, or the integrity check fails.

Usage:
    python bench/soak.py [--duration 600] [--clients 8] [--kill-at 0.8] [--kv-cache-memory 96MiB]
        [--length-scale 0.5] [--output-tokens 48] [--json out.json] [--serve-args='...']
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_gaps import paste_text, percentile  # noqa: E402

from kvreplay.bench.workload import WorkloadSpec, sample_buckets_and_lengths  # noqa: E402
from kvreplay.server import launch  # noqa: E402

CHARS_PER_TOKEN = 4          # the Python docs through SmolLM2's tokenizer, roughly
STARTUP_TIMEOUT_S = 900.0    # a first start may compile the CPU kernels
WARMUP_S = 30.0              # resident memory is read this long after a start
RSS_EVERY_S = 10.0
# The engine returns free heap pages every 256 steps, so resident memory saw-tooths (~100 MiB
# here); besides the two readings of a life, the medians of its readings in the first and last
# RSS_WINDOW_S after the warm-up, for a life that lasts both windows.
RSS_WINDOW_S = 120.0


class Server:
    """One `kvreplay serve` process after another on the same port and flags."""

    def __init__(self, flags: list[str], log_path: str):
        self.port = launch.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags, self.log = flags, open(log_path, "a")
        self.process: subprocess.Popen | None = None
        self.up = False

    def start(self) -> float:
        """Start and wait until /health answers 200; the seconds it took."""
        self.process = launch.spawn(self.flags, self.port, self.log,
                                    env={k: v for k, v in os.environ.items() if k != "KVREPLAY_API_KEY"})
        try:
            seconds = launch.wait_healthy(self.process, self.url, STARTUP_TIMEOUT_S, poll_s=0.2)
        except launch.ServerStartError as exc:
            raise RuntimeError(f"{exc}: see {self.log.name}") from None
        self.up = True
        return seconds

    def rss_mib(self) -> float | None:
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        found = re.search(r"VmRSS:\s+(\d+) kB", status)
        return int(found.group(1)) / 1024 if found else None

    def kill(self) -> int:
        self.up = False
        pid = self.process.pid
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        return pid

    def stop(self) -> int:
        self.up = False
        return launch.stop(self.process, timeout_s=60)


def metric(url: str, name: str, **labels: str) -> float | None:
    """One sample of the server's /metrics (prometheus_client's parser), or None if absent."""
    text = httpx.get(url + "/metrics", timeout=60).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def bad_bodies(model: str, context_tokens: int) -> list[tuple[str, str | bytes]]:
    """(path, body) pairs that must each get a 4xx."""
    long_prompt = paste_text(CHARS_PER_TOKEN * context_tokens * 2)
    return [
        ("/v1/chat/completions", b'{"model": "x", "messages": [{"role": "user", "content": "hi"'),
        ("/v1/chat/completions", json.dumps({"model": model, "messages": [{"role": "wizard", "content": "hi"}]})),
        ("/v1/completions", json.dumps({"model": model, "prompt": "hi", "max_tokens": -3})),
        ("/v1/completions", json.dumps({"model": "no-such-model", "prompt": "hi"})),
        ("/v1/completions", json.dumps({"model": model, "prompt": "hi", "temperature": "hot"})),
        ("/v1/completions", json.dumps({"model": model, "prompt": long_prompt, "max_tokens": 4})),
    ]


class Soak:
    def __init__(self, args, server: Server, model: str):
        self.args, self.server, self.model = args, server, model
        spec = WorkloadSpec(num_requests=4096, seed=args.seed, length_scale=args.length_scale,
                            output_tokens=args.output_tokens, num_warmup=0)
        self.lengths = [int(n) for n in sample_buckets_and_lengths(spec)[1]]
        self.text = paste_text(CHARS_PER_TOKEN * (max(self.lengths) + 64) * 4)
        self.bad = bad_bodies(model, args.context_tokens)
        self.outcomes: Counter = Counter()
        self.latencies: dict[str, list[float]] = {"stream": [], "whole": []}
        self.retry_after_missing = 0
        self.errors: list[str] = []
        self.deadline = 0.0

    def _prompt(self, rng: random.Random) -> str:
        tokens = self.lengths[rng.randrange(len(self.lengths))]
        start = rng.randrange(len(self.text) // 2)
        return self.text[start:start + tokens * CHARS_PER_TOKEN]

    def _record(self, kind: str, status: int | str, expected: bool, detail: str = "") -> None:
        self.outcomes[(kind, str(status))] += 1
        if not expected:
            self.errors.append(f"{kind}: {status} {detail}"[:300])

    def _record_lost(self, error: Exception) -> None:
        """A connection error: expected while the server is down (killed), an error otherwise."""
        up = self.server.up
        self._record("transport" if up else "killed", type(error).__name__, not up, str(error))

    async def _good(self, client: httpx.AsyncClient, rng: random.Random, history: list) -> None:
        stream, chat = rng.random() < 0.5, rng.random() < 0.5
        common = {"model": self.model, "max_tokens": self.args.output_tokens, "stream": stream,
                  "temperature": 0.0, "ignore_eos": True}
        if chat:
            if history and rng.random() < 1 / 3:
                messages = history + [{"role": "user", "content": self._prompt(rng)[:400]}]
            else:
                messages = [{"role": "user", "content": self._prompt(rng)}]
            path, body = "/v1/chat/completions", dict(common, messages=messages)
        else:
            path, body = "/v1/completions", dict(common, prompt=self._prompt(rng))
        kind = ("chat" if chat else "completion") + (" stream" if stream else "")
        started = time.monotonic()
        if stream:
            async with client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    self._record(kind, response.status_code, response.status_code == 429, response.text)
                    await self._back_off(response)
                    return
                text, finished = [], None
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        text.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
                        finished = choice.get("finish_reason") or finished
                    elif line == "data: [DONE]":
                        break
            ok = finished == "length"
            self._record(kind, 200 if ok else f"200 ended {finished}", ok)
            reply = "".join(text)
        else:
            response = await client.post(path, json=body)
            if response.status_code != 200:
                self._record(kind, response.status_code, response.status_code == 429, response.text)
                await self._back_off(response)
                return
            choice = response.json()["choices"][0]
            self._record(kind, 200, True)
            reply = choice.get("message", {}).get("content") if chat else choice.get("text")
        self.latencies["stream" if stream else "whole"].append(time.monotonic() - started)
        if chat:
            history[:] = messages + [{"role": "assistant", "content": reply or ""}]
            if len(history) > 6:
                history.clear()

    @staticmethod
    async def _back_off(response: httpx.Response) -> None:
        """A 429 is retried after its Retry-After (at most 5 s), as a polite client does."""
        if response.status_code == 429:
            try:
                await asyncio.sleep(min(float(response.headers.get("retry-after", 1)), 5.0))
            except ValueError:
                await asyncio.sleep(1.0)

    async def _disconnect(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"model": self.model, "prompt": self._prompt(rng), "max_tokens": self.args.output_tokens,
                "stream": True, "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            chunks = 0
            async for line in response.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 2:
                    break  # leaving the block closes the connection mid-stream
            self._record("disconnect", response.status_code, response.status_code in (200, 429))
        await self._back_off(response)

    async def _bad(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        path, body = self.bad[rng.randrange(len(self.bad))]
        response = await client.post(path, content=body, headers={"content-type": "application/json"})
        # a 4xx of any kind (429 too: a full queue may answer before the body is judged)
        self._record("bad", response.status_code, 400 <= response.status_code < 500, response.text)
        await self._back_off(response)

    async def client(self, index: int) -> None:
        rng = random.Random(f"{self.args.seed}-{index}")
        history: list = []
        async with httpx.AsyncClient(base_url=self.server.url, timeout=600) as client:
            while time.monotonic() < self.deadline:
                if not self.server.up:
                    await asyncio.sleep(0.2)
                    continue
                draw = rng.random()
                try:
                    if draw < self.args.bad:
                        await self._bad(client, rng)
                    elif draw < self.args.bad + self.args.disconnect:
                        await self._disconnect(client, rng)
                    else:
                        await self._good(client, rng, history)
                except (httpx.TransportError, httpx.StreamError) as error:
                    self._record_lost(error)

    async def burst(self, client: httpx.AsyncClient) -> None:
        size = self.args.max_queued_seqs + 16
        body = {"model": self.model, "prompt": "Count to ten:", "max_tokens": 2}

        async def one():
            try:
                response = await client.post("/v1/completions", json=body)
            except httpx.TransportError as error:
                self._record_lost(error)
                return
            if response.status_code == 429 and "retry-after" not in response.headers:
                self.retry_after_missing += 1
                self.errors.append("429 without Retry-After")
            self._record("burst", response.status_code, response.status_code in (200, 429), response.text)
        await asyncio.gather(*(one() for _ in range(size)))


def rss_windows(readings: list[tuple[float, float]]) -> dict:
    """Medians of a life's readings (seconds since its start, MiB) in the first and the last
    RSS_WINDOW_S after the warm-up, and their ratio less one; {} for a life shorter than both."""
    if not readings or readings[-1][0] - WARMUP_S < 2 * RSS_WINDOW_S:
        return {}
    first = [mib for t, mib in readings if t < WARMUP_S + RSS_WINDOW_S]
    last = [mib for t, mib in readings if t > readings[-1][0] - RSS_WINDOW_S]
    first_mib, last_mib = percentile(first, 50), percentile(last, 50)
    return dict(rss_first_window_median_mib=round(first_mib, 1), rss_last_window_median_mib=round(last_mib, 1),
                rss_window_growth=round(last_mib / first_mib - 1, 4))


async def run(args, server: Server, model: str, tier_dir: str) -> dict:
    soak = Soak(args, server, model)
    started = time.monotonic()
    soak.deadline = started + args.duration
    lives = [dict(start_s=round(server.first_start_s, 1))]
    kill_at = started + args.kill_at * args.duration if args.kill_at else None
    crash: dict = {}
    rss_timeline: list[tuple[int, int]] = []

    async def watch():
        next_burst, next_rss = started + args.burst_every, started
        async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=httpx.Limits(
                max_connections=args.max_queued_seqs + 32)) as client:
            while time.monotonic() < soak.deadline:
                now = time.monotonic()
                life = lives[-1]
                if "rss_warm_mib" not in life and now - life.setdefault("_t0", started) > WARMUP_S:
                    life["rss_warm_mib"] = server.rss_mib()
                if server.up and now >= next_rss:
                    next_rss = now + RSS_EVERY_S
                    rss = server.rss_mib()
                    rss_timeline.append((round(now - started), round(rss or 0)))
                    if rss and now - life["_t0"] >= WARMUP_S:
                        life.setdefault("_rss", []).append((now - life["_t0"], rss))
                if kill_at is not None and now >= kill_at and not crash:
                    life["rss_end_mib"] = server.rss_mib()
                    pid = server.kill()
                    left = sorted(p.name for p in Path(tier_dir).rglob("*.tmp"))
                    files = len(list(Path(tier_dir).rglob("*.kvt")))
                    restart_s = await asyncio.to_thread(server.start)
                    disk = metric(server.url, "kvreplay_kv_tier_bytes", tier="disk")
                    remaining = [n for n in (p.name for p in Path(tier_dir).rglob("*.tmp")) if f".{pid}." in n
                                 or f"-{pid}." in n]
                    crash.update(at_s=round(now - started, 1), killed_pid=pid, restart_s=round(restart_s, 1),
                                 temporaries_left=len(left), temporaries_after_restart=len(remaining),
                                 tier_files_at_kill=files,
                                 tier_disk_mib_after_restart=round(disk / 2**20, 1) if disk is not None else None)
                    lives.append(dict(start_s=round(restart_s, 1), _t0=time.monotonic()))
                if now >= next_burst and server.up:
                    next_burst = now + args.burst_every
                    await soak.burst(client)
                await asyncio.sleep(0.5)
    await asyncio.gather(watch(), *(soak.client(i) for i in range(args.clients)))
    wall = time.monotonic() - started
    lives[-1]["rss_end_mib"] = server.rss_mib()
    debug = httpx.get(server.url + "/debug/kv", timeout=60)
    if crash:
        crash["torn_files_discarded"] = metric(server.url, "kvreplay_kv_tier_corrupted_files_total")
        crash["tier_blocks_loaded_after_restart"] = metric(server.url, "kvreplay_kv_tier_loads_total")
    exit_code = server.stop()
    for life in lives:
        life.pop("_t0", None)
        warm, end = life.get("rss_warm_mib"), life.get("rss_end_mib")
        if warm and end:
            life["rss_growth"] = round(end / warm - 1, 4)
        life.update(rss_windows(life.pop("_rss", [])))
    by_status = Counter()
    for (kind, status), count in soak.outcomes.items():
        by_status[status] += count
    return dict(
        wall_s=round(wall, 1), clients=args.clients, requests=sum(soak.outcomes.values()),
        served=sum(map(len, soak.latencies.values())),
        outcomes={f"{k} -> {s}": n for (k, s), n in sorted(soak.outcomes.items())},
        by_status=dict(sorted(by_status.items())),
        five_xx=sum(n for s, n in by_status.items() if s.startswith("5")),
        errors=len(soak.errors), error_samples=soak.errors[:10], retry_after_missing=soak.retry_after_missing,
        latency_s={kind: dict(n=len(v), p50=round(percentile(v, 50), 2), p99=round(percentile(v, 99), 2))
                   for kind, v in soak.latencies.items() if v},
        lives=lives, rss_mib_every_10_s=rss_timeline, crash=crash or None, integrity=debug.json() if debug.status_code in (200, 500) else debug.text,
        exit_code_after_sigterm=exit_code)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--clients", type=int, default=8, help="closed-loop clients (default 8)")
    parser.add_argument("--kill-at", type=float, default=0.8,
                        help="kill -9 the server at this share of the duration and restart it (0: never)")
    parser.add_argument("--kv-cache-memory", default="96MiB",
                        help="the server's KV budget (default 96MiB: one of the mix's longest requests at "
                             "--length-scale 0.5, or ~8 of its short ones)")
    parser.add_argument("--policy", default="replay")
    parser.add_argument("--length-scale", type=float, default=0.5, help="scales the serving mix's prompt lengths")
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--disconnect", type=float, default=0.05, help="share of requests that hang up mid-stream")
    parser.add_argument("--bad", type=float, default=0.02, help="share of malformed requests")
    parser.add_argument("--burst-every", type=float, default=60.0, help="seconds between bursts over the queue")
    parser.add_argument("--max-queued-seqs", type=int, default=32)
    parser.add_argument("--tier", choices=("disk", "memory", "off"), default="disk",
                        help="the session tier: 16MiB of memory over a temporary directory (disk), "
                             "memory only, or none")
    parser.add_argument("--context-tokens", type=int, default=8192, help="the model's context (for the too-long prompt)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-args", default="", help="more `kvreplay serve` flags")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.clients <= 0 or not 0 <= args.kill_at < 1:
        parser.error("--duration and --clients must be positive, --kill-at in [0, 1)")
    if not 0 <= args.bad + args.disconnect <= 1:
        parser.error("--bad + --disconnect must be a share in [0, 1]")
    return args


def soak(argv=None) -> dict:
    """Run the soak; the report (also printed as JSON, and written to --json)."""
    args = parse_args(argv)
    tier_dir = tempfile.mkdtemp(prefix="kvreplay-soak-tier-")
    flags = ["--dtype", args.dtype, "--policy", args.policy, "--kv-cache-memory", args.kv_cache_memory,
             "--max-queued-seqs", str(args.max_queued_seqs), "--debug-endpoints"]
    if args.tier != "off":
        flags += ["--kv-tier-memory", "16MiB"] + (["--kv-tier-dir", tier_dir] if args.tier == "disk" else [])
    flags += shlex.split(args.serve_args)
    if args.model:
        flags += ["--model", args.model]
    log_path = tempfile.mktemp(prefix="kvreplay-soak-", suffix=".log")
    server = Server(flags, log_path)
    server.first_start_s = server.start()
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    print(f"server up in {server.first_start_s:.1f} s on {server.url} (log {log_path}); "
          f"soaking for {args.duration:.0f} s with {args.clients} clients", file=sys.stderr)
    try:
        report = asyncio.run(run(args, server, model, tier_dir))
    finally:
        if server.process.poll() is None:
            server.process.kill()
        shutil.rmtree(tier_dir, ignore_errors=True)
    integrity = report["integrity"]
    crash = report["crash"]
    report.update(
        command=" ".join(["python bench/soak.py", *(argv if argv is not None else sys.argv[1:])]),
        server_flags=flags, log=log_path,
        passed=bool(isinstance(integrity, dict) and integrity.get("integrity") == "ok" and not report["errors"]
                    and (not crash or crash["temporaries_after_restart"] == 0)))
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return report


def main(argv=None) -> int:
    return 0 if soak(argv)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

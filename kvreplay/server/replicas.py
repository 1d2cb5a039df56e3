"""`kvreplay serve --replicas N`: N engine replicas as a Ray Serve deployment behind the same
OpenAI-compatible app (docs/multi-node.md).

    client ── HTTP ──▶ Serve proxy ──▶ Ingress (1 replica, no engine): reads the body, computes
                                       its prefix hashes (prefix_router.py), calls
                                       EngineReplica.handle through a deployment handle
                                              │ Serve's router runs PrefixAffinityRouter
                                              ▼
                       EngineReplica x N: the whole kvreplay app (build_app) over its own engine;
                       `handle` runs one HTTP request through it in process and streams the
                       response back (status and headers first, then the body's chunks)

Every route (auth, validation and its 4xx, streaming, usage.kv, /metrics of that replica) is the
single-process server's. The response names the replica in `x-kvreplay-replica` (Serve's
replica id @ host : pid). A replica that
dies mid-stream ends the stream with an SSE error event (a non-streamed request gets 503); Serve
stops routing to it and the others take new requests.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time

from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvreplay.config import EngineConfig
from kvreplay.server.config import ServerConfig
from kvreplay.server.formatting import error_body
from kvreplay.server.prefix_router import PrefixAffinityRouter, prefix_hashes

logger = logging.getLogger(__name__)
REPLICA_HEADER = "x-kvreplay-replica"
_HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


def _replica_events_endpoint(endpoint: str | None, local_rank: int) -> str | None:
    """Replica i on a node publishes KV events on the endpoint's port + i."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return endpoint
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + local_rank}"


class EngineReplica:
    """One engine and the app over it; `handle` is what the ingress calls."""

    def __init__(self, engine_fields: dict, server_fields: dict, threads: int):
        import torch
        from kvreplay.api import LLM
        from kvreplay.server.app import build_app
        from kvreplay.server.async_engine import AsyncEngine
        torch.set_num_threads(threads)
        context = serve.get_replica_context()
        self.name = f"{context.replica_id.unique_id}@{socket.gethostname()}:{os.getpid()}"
        engine_fields = dict(engine_fields, kv_events=_replica_events_endpoint(
            engine_fields.get("kv_events"), context.rank.local_rank))
        config = ServerConfig(**server_fields)
        llm = LLM(**engine_fields)
        self.engine = AsyncEngine(llm, max_queued_seqs=config.max_queued_seqs,
                                  max_seqs_per_request=config.max_seqs_per_request,
                                  max_prompt_bytes=config.max_prompt_bytes,
                                  tokenize_nice=config.tokenize_nice)
        self.app = build_app(self.engine, config)
        self.engine.start()  # (the app's lifespan is not run in process)

    def record_routing_stats(self) -> dict:
        snap = self.engine.snapshot
        return {"waiting": snap.num_waiting, "running": snap.num_running,
                "kv_usage": snap.num_used_blocks / snap.num_blocks if snap.num_blocks else 0.0}

    async def handle(self, affinity: list[int], method: str, path: str, query: bytes,
                     headers: list, body: bytes):
        """Run one HTTP request through the app; yields (status, headers), then body chunks.
        `affinity` is read by the router only."""
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
                 "root_path": "", "headers": headers, "client": ("127.0.0.1", 0),
                 "server": ("127.0.0.1", 80)}
        task = asyncio.create_task(self.app(scope, receive, messages.put))
        try:
            while True:
                message = await messages.get()
                if message["type"] == "http.response.start":
                    yield message["status"], [(k, v) for k, v in message.get("headers", [])
                                              if k.lower() not in _HOP_HEADERS] + \
                        [(REPLICA_HEADER.encode(), self.name.encode())]
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
            await task
        finally:
            gone.set()  # the client left early: the app sees a disconnect and aborts its requests
            if not task.done():
                await asyncio.wait({task}, timeout=10)


class Ingress:
    """Forwards every request to an engine replica through Serve's router."""

    def __init__(self, engines):
        self.engines = engines

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        call = self.engines.options(stream=True).handle.remote(
            prefix_hashes(body) if request.method == "POST" else [], request.method, request.url.path,
            request.url.query.encode(), [(k, v) for k, v in request.headers.raw if k.lower() != b"host"],
            body)
        try:
            status, headers = await call.__anext__()
        except Exception as exc:  # the replica died before answering: no stream was promised
            logger.warning("replica failed before answering %s: %s", request.url.path, exc)
            return JSONResponse(error_body(f"the replica serving this request failed: {exc}",
                                           "server_error"), status_code=503)
        return StreamingResponse(_rest(call), status_code=status,
                                 headers={k.decode(): v.decode() for k, v in headers})


async def _rest(call):
    """The body's chunks; a replica lost mid-stream ends it with an SSE error event."""
    try:
        async for chunk in call:
            yield chunk
    except Exception as exc:  # an actor death surfaces as a RayActorError here
        logger.warning("replica failed mid-stream: %s", exc)
        yield b'data: {"error": {"message": "the replica serving this stream failed", ' \
              b'"type": "server_error", "code": "replica_failed"}}\n\n'


def build_application(engine_config: EngineConfig, config: ServerConfig):
    """The Serve application: N EngineReplica behind one Ingress."""
    engine_fields = {name: getattr(engine_config, name) for name in engine_config.__dataclass_fields__}
    server_fields = {name: getattr(config, name) for name in config.__dataclass_fields__}
    router = RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                 request_router_kwargs={"routing": config.replica_routing},
                                 request_routing_stats_period_s=1.0)
    engines = serve.deployment(EngineReplica, name="kvreplay-engine", num_replicas=config.replicas,
                               max_ongoing_requests=config.max_queued_seqs,
                               ray_actor_options={"num_cpus": config.replica_threads},
                               request_router_config=router)
    ingress = serve.deployment(Ingress, name="kvreplay-ingress", num_replicas=1,
                               max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engines.bind(engine_fields, server_fields, config.replica_threads))


def _wait_for_replicas(count: int, timeout_s: float = 600.0) -> None:
    """Until `count` engine replicas run (serve.run may return once the first is healthy)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        application = serve.status().applications.get("kvreplay")
        engines = application.deployments.get("kvreplay-engine") if application else None
        if engines is not None and engines.replica_states.get("RUNNING", 0) >= count:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{count} engine replicas did not all start in {timeout_s:.0f} s")


def run_replicas(engine_config: EngineConfig, config: ServerConfig) -> None:
    """Start (or join) the Ray cluster, run the application until SIGTERM or Ctrl-C."""
    import ray
    if config.ray_address:
        ray.init(address=config.ray_address, include_dashboard=False)
    else:
        ray.init(num_cpus=config.replicas * config.replica_threads + 1, include_dashboard=False)
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(build_application(engine_config, config), name="kvreplay", route_prefix="/")
    _wait_for_replicas(config.replicas)
    print(f"serving '{config.served_model_name}' on http://{config.host}:{config.port}/v1 with "
          f"{config.replicas} replicas ({config.replica_routing} routing)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()

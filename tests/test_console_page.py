"""The web console's routes on an app over a tiny engine (conftest's random Llama): the page and
its files load without the API key under a same-origin Content Security Policy, / redirects to
it, the state endpoint refuses a request without the key, `console=False` serves none of it; the
snapshot page of `bench serve --kv-map` is one file that fetches nothing."""
from __future__ import annotations

import json
import re

import pytest

from kvreplay.server.console import CSP, snapshot_page

KEY = "console-key"


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    from kvreplay import LLM
    return LLM(model=tiny_model, dtype="float32", kv_cache_memory="256KiB", block_size=8)


def _client(llm, **config):
    from fastapi.testclient import TestClient
    from kvreplay.server.app import build_app
    from kvreplay.server.async_engine import AsyncEngine
    from kvreplay.server.config import ServerConfig
    return TestClient(build_app(AsyncEngine(llm), ServerConfig(**config)), follow_redirects=False)


def test_console_loads_without_the_key_and_the_state_needs_it(tiny_llm):
    with _client(tiny_llm, api_key=KEY) as client:
        page = client.get("/console")
        assert page.status_code == 200 and page.headers["content-security-policy"] == CSP
        assert 'id="key-dialog"' in page.text and 'id="chat-form"' in page.text
        assert client.get("/").headers["location"] == "/console"
        assert client.get("/").status_code == 307
        for path, kind in (("/console/console.js", "javascript"), ("/console/console.css", "css")):
            asset = client.get(path)
            assert asset.status_code == 200 and kind in asset.headers["content-type"]
        refused = client.get("/v1/kv/state")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/kv/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
        state = client.get("/v1/kv/state", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert state["pool"]["num_blocks"] == tiny_llm.engine.kv.num_blocks
        assert set(state["watermarks"]) == {"low", "admit", "high"}


def test_no_console_serves_no_page(tiny_llm):
    with _client(tiny_llm, console=False) as client:
        for path in ("/", "/console", "/console/console.js"):
            assert client.get(path).status_code == 404
        assert client.get("/v1/kv/state").status_code == 200  # the API route stays


def test_page_names_no_other_origin():
    """Every URL the page and its files mention is this origin's (or a data: URL)."""
    from kvreplay.server.console import STATIC_DIR
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        assert not re.search(r"(https?:)?//[\w.-]+\.\w+/", text.replace("http-equiv", "")), path.name
        for url in re.findall(r'(?:src|href)="([^"]*)"', text):
            assert url.startswith("/console/"), url


def test_snapshot_page_embeds_states_and_fetches_nothing():
    states = [{"time": 1.0, "step": 3, "sequences": [], "note": "</script><b>"}]
    page = snapshot_page(states, title="run")
    assert 'src="' not in page and 'href="' not in page  # script and style inlined
    assert "default-src 'none'" in page
    blob = re.search(r'<script id="kv-states" type="application/json">(.*?)</script>', page, re.S)
    assert json.loads(blob.group(1)) == {"title": "run", "states": states}


def test_bench_serve_writes_a_kv_map(tiny_model, tmp_path):
    """`bench serve --kv-map`: the page with the run's states, from the first step to the end."""
    from kvreplay.cli import main
    out = tmp_path / "map.html"
    assert main(["bench", "serve", "--model", tiny_model, "--num-requests", "3", "--length-scale", "0.25",
                 "--output-tokens", "6", "--num-warmup", "0", "--kv-cache-memory", "4MiB", "--dtype", "float32",
                 "--policy", "replay", "--trim", "prefill", "--window-tokens", "16",
                 "--need-layers", "all", "--heavy-tokens", "0", "--no-progress",
                 "--kv-map", str(out)]) == 0
    page = out.read_text()
    blob = re.search(r'<script id="kv-states" type="application/json">(.*?)</script>', page, re.S)
    states = json.loads(blob.group(1))["states"]
    assert states[0]["sequences"] and not states[-1]["sequences"]
    assert states[-1]["totals"]["completion_tokens"] == 18, states[-1]["totals"]
    assert [s["time"] for s in states] == sorted(s["time"] for s in states)
    for seq in (seq for state in states for seq in state["sequences"]):
        assert sum(count for _, count in seq["runs"]) == seq["num_tokens"]
    assert any(zone == "dropped" for state in states[:1] for seq in state["sequences"]
               for zone, _ in seq["runs"])


def test_kv_map_polls_a_server_until_stopped():
    """`bench serve --url ... --kv-map`: the server's /v1/kv/state, read until the run ends."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvreplay.bench.kv_map import poll_server
    paths = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            paths.append(self.path)
            body = json.dumps({"time": len(paths)}).encode()
            self.send_response(200 if len(paths) != 2 else 503)  # a failed read is skipped
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    states, stop = [], threading.Event()
    poller = threading.Thread(target=poll_server, args=(f"http://127.0.0.1:{server.server_port}/",
                                                        states, stop, 0.02))
    poller.start()
    while len(paths) < 4:
        stop.wait(0.01)
    stop.set()
    poller.join(timeout=5)
    server.shutdown()
    assert not poller.is_alive() and set(paths) == {"/v1/kv/state"}
    assert states[:3] == [{"time": 1}, {"time": 3}, {"time": 4}]

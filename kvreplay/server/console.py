"""The web console (docs/architecture.md §7): a chat playground and a live map of the KV cache in
one hand-written page (static/console.html, .js, .css: no build step, nothing fetched off the
server's origin), and the JSON it polls, `GET /v1/kv/state`.

The page and its two files need no API key (a browser sends none when it opens a URL); the page
asks for the key when the state endpoint answers 401 and sends it as a Bearer header. A Content
Security Policy lets the page talk to its own origin only. `snapshot_page` inlines the same page
with recorded states for `kvreplay bench serve --kv-map` (a file that opens with no server).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

STATIC_DIR = Path(__file__).parent / "static"
PAGE_PATH = "/console"
ASSETS = {"/console/console.js": ("console.js", "text/javascript; charset=utf-8"),
          "/console/console.css": ("console.css", "text/css; charset=utf-8")}
PATHS = ("/", PAGE_PATH, *ASSETS)  # served without the API key
STATE_PATH = "/v1/kv/state"
# Only this origin: no CDN, no beacon, no form posted elsewhere, not framed by another site.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
# The snapshot file opens from disk: everything inline, nothing fetched at all.
SNAPSHOT_CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'"
_CSS_TAG = '<link rel="stylesheet" href="/console/console.css">'
_JS_TAG = '<script src="/console/console.js"></script>'


@lru_cache(maxsize=None)
def _asset(name: str) -> str:
    return (STATIC_DIR / name).read_text(encoding="utf-8")


def add_state_route(app: FastAPI) -> None:
    """GET /v1/kv/state: the KV map drawn by the engine thread (AsyncEngine.kv_state)."""
    @app.get(STATE_PATH)
    async def kv_state(request: Request):
        """Pool usage per tier, watermarks, counters and each live sequence's tokens by zone."""
        return await request.app.state.server.engine.kv_state()


def add_console(app: FastAPI) -> None:
    """Serve the page at /console, its script and style, and redirect / to it."""
    headers = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache",
               "X-Content-Type-Options": "nosniff"}

    @app.get("/", include_in_schema=False)
    async def root():
        return RedirectResponse(PAGE_PATH)

    @app.get(PAGE_PATH, include_in_schema=False)
    async def console_page():
        return HTMLResponse(_asset("console.html"), headers=headers)

    for path, (name, media_type) in ASSETS.items():
        def serve(name=name, media_type=media_type):
            return Response(_asset(name), media_type=media_type, headers=headers)
        app.add_api_route(path, serve, methods=["GET"], include_in_schema=False)


def snapshot_page(states: list[dict], title: str = "kvreplay KV map") -> str:
    """The console as one self-contained file replaying `states` (kv_map.kv_state pictures,
    oldest first): its script and style inlined, the states embedded as JSON."""
    page = _asset("console.html")
    assert _CSS_TAG in page and _JS_TAG in page, "console.html lost its asset tags"
    # "</" cannot end the script element early once escaped; JSON reads "<\/" as "</"
    data = json.dumps({"title": title, "states": states}, separators=(",", ":")).replace("</", "<\\/")
    head = f'<meta http-equiv="Content-Security-Policy" content="{SNAPSHOT_CSP}">\n'
    return (page.replace("<head>", "<head>\n" + head, 1)
            .replace(_CSS_TAG, f"<style>\n{_asset('console.css')}</style>")
            .replace(_JS_TAG, f'<script id="kv-states" type="application/json">{data}</script>\n'
                              f"<script>\n{_asset('console.js')}</script>"))

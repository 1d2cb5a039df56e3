"""The web console in a real browser: Debian's headless Chromium, driven by Playwright, opens
/console of a real `kvreplay serve --api-key ... --policy replay --trim prefill`, gives the key
it asks for, chats (the answer streams in, then its usage.kv), watches a long request's bar go
from hot to dropped, and never sends a request off the server's origin. A screenshot is saved
under $KVREPLAY_TEST_ARTIFACTS (default: <tmp>/kvreplay-test-artifacts)."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from server_process import serving

CHROMIUM = "/usr/bin/chromium"
API_KEY = "browser-key"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                 reason=f"no {CHROMIUM}: install Debian's chromium "
                                        "(`make setup-browser` or apt-get install chromium)")]
# A prompt whose prefill runs in 32-token chunks over many steps: its middle is hot for a while,
# then trim="prefill" drops it when the prefill ends.
LONG_PROMPT = " ".join(f"Line {i}: the river town kept its ledgers in a stone house by the mill."
                       for i in range(40)) + " Which line mentions the mill first?"


@pytest.fixture(scope="module")
def server():
    # SmolLM2-135M's calibrated replay knobs given outright: no calibration pass at startup
    yield from serving("--policy", "replay", "--trim", "prefill", "--window-tokens", "32",
                       "--max-num-batched-tokens", "32", "--need-layers", "18,20-21,23",
                       "--heavy-tokens", "32", "--replay-threshold", "0.61", api_key=API_KEY)


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"])
        yield browser
        browser.close()


def _until(check, timeout_s: float, what: str, every_s: float = 0.01) -> None:
    """Poll `check()` from Python (the page's CSP forbids the eval that wait_for_function uses)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not seen within {timeout_s} s: {what}"
        time.sleep(every_s)


def _artifact_dir() -> Path:
    path = Path(os.environ.get("KVREPLAY_TEST_ARTIFACTS")
                or Path(tempfile.gettempdir()) / "kvreplay-test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_console_chats_and_shows_a_bar_go_from_hot_to_dropped(server, browser):
    assert httpx.get(server.base_url + "/v1/kv/state", timeout=10).status_code == 401
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(server.base_url + "/console?poll=50")
        page.wait_for_selector("#key-dialog:not([hidden])", timeout=10_000)  # it asks for the key
        page.fill("#key-input", API_KEY)
        page.click("#key-form button")
        _until(lambda: page.inner_text("#status").startswith("live"), 10, "live status")

        # a short chat: the answer appears before the final chunk's usage, then usage.kv
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "40")
        page.fill("#prompt", "Name three colors.")
        page.click("#send")
        answer, usage = page.locator(".msg.assistant .answer"), page.locator(".msg.assistant .usage")
        _until(lambda: answer.count() and answer.inner_text().strip() and not usage.count(), 60,
               "part of the answer before its usage")
        page.wait_for_selector(".msg.assistant .usage [data-kv='completion_tokens']", timeout=60_000)
        assert page.inner_text(".msg.assistant .answer").strip()

        # a long prompt: its bar shows a hot middle while it prefills, then the middle dropped
        page.click("#new-chat")
        page.fill("#max-tokens", "48")
        page.fill("#prompt", LONG_PROMPT)
        page.click("#send")
        hot = page.wait_for_selector(".req:has(.bar span[data-zone='hot'])", timeout=60_000)
        request_id = hot.get_attribute("data-request")
        page.wait_for_selector(f".req[data-request='{request_id}'] .bar span[data-zone='dropped']",
                               timeout=60_000)
        page.screenshot(path=str(_artifact_dir() / "console.png"), full_page=True)
        page.wait_for_selector(".msg.assistant .usage [data-kv='dropped_tokens']", timeout=60_000)
        replays = page.inner_text("[data-counter='replays / min'] dd")
        assert replays != "", replays
    finally:
        page.close()
    assert not errors, errors
    assert requested and all(url.startswith(server.base_url + "/") for url in requested), requested


def test_kv_map_snapshot_replays_in_the_browser(browser, tiny_model, tmp_path):
    """The `bench serve --kv-map` page opens from disk, fetches nothing, and its scrubber shows
    a recorded state's bars."""
    from kvreplay import LLM, SamplingParams
    from kvreplay.bench.kv_map import KVMapRecorder
    from kvreplay.server.console import snapshot_page
    llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="1MiB", policy="replay",
              trim="prefill", window_tokens=16, need_layers="all", heavy_tokens=0)
    recorder = KVMapRecorder(interval_s=0)
    engine = llm.engine
    for count in (90, 140):
        engine.add_request(list(range(200, 200 + count)), SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        recorder.record(engine, engine.step(), float(engine.counters.steps))
    path = tmp_path / "kv-map.html"
    path.write_text(snapshot_page(recorder.states, title="tiny run"))
    page = browser.new_page(viewport={"width": 1200, "height": 700})
    requested, errors = [], []
    page.on("request", lambda request: requested.append(request.url))
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(path.as_uri())
        assert page.inner_text("#status") == f"recorded: {len(recorder.states)} states"
        assert page.is_visible("#scrub") and not page.is_visible("#chat")
        page.fill("#scrub", "1")
        assert page.locator(".req").count() == 2
        assert page.locator(".bar span[data-zone='dropped']").count() == 2
        page.screenshot(path=str(_artifact_dir() / "kv-map.png"), full_page=True)
    finally:
        page.close()
    assert not errors, errors
    assert requested == [path.as_uri()], requested

"""CORS in a real browser: headless Chromium (Debian's ``chromium``, driven by Playwright) opens
a page on another origin, ``http://app.test:<port>`` (a tiny aiohttp server on loopback that
Chromium's resolver maps the name to), and calls the API of a live server (the embedded
model, one stage) with ``fetch``, as a web app does:

- from the listed origin, with the API key, a streamed chat completion is read off the
  response body as server-sent events, and says what the same completion says unstreamed; the
  page reads ``x-request-id`` (exposed); an Anthropic message with the headers its SDK sends
  from a browser (``x-api-key``, ``anthropic-version``, ``anthropic-dangerous-direct-browser-
  access``) goes through too;
- without an API key, the listed origin passes the server's same-origin check, which refuses
  every other page;
- from ``http://evil.test:<port>``, not listed, the preflight is refused and the browser blocks
  the call: the page sees ``TypeError: Failed to fetch`` and the console Chromium's CORS error.

Each page's console and a screenshot of its result are written to the test's tmp_path.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from mlxppd.app.api_app import api_app
from tests.support.http import LiveServer, post

CHROMIUM = shutil.which("chromium")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="needs Debian's chromium (scripts/test.sh installs it when run as root)",
    ),
]

KEY = "sk-cors-browser-test"
MODEL = "smollm"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8
# As tests/http/test_console.py starts it, and the page origins' names mapped to loopback.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--host-resolver-rules=MAP app.test 127.0.0.1, MAP evil.test 127.0.0.1",
    "--disable-features=HttpsUpgrades",
]  # fmt: skip
CORS_BLOCKED = "has been blocked by CORS policy"

#: a streamed chat completion, read as a web app reads one: the body's bytes as SSE events
STREAM_CHAT = """async ({url, key, body}) => {
  const response = await fetch(url + "/v1/chat/completions", {
    method: "POST",
    headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json",
              "X-Stainless-Lang": "js", "X-Stainless-OS": "Linux",
              "X-Stainless-Retry-Count": "0"},
    body: JSON.stringify({...body, stream: true}),
  });
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let raw = "";
  for (;;) {
    const {done, value} = await reader.read();
    if (done) break;
    raw += decoder.decode(value, {stream: true});
  }
  const events = raw.split("\\n\\n").filter(e => e.startsWith("data: ")).map(e => e.slice(6));
  let text = "";
  for (const e of events.filter(e => e !== "[DONE]")) {
    text += JSON.parse(e).choices[0]?.delta?.content ?? "";
  }
  return {status: response.status, type: response.headers.get("content-type"),
          requestId: response.headers.get("x-request-id"), text,
          last: events[events.length - 1], events: events.length};
}"""

#: an Anthropic message with the headers its SDK sends from a browser
MESSAGE = """async ({url, key, body}) => {
  const response = await fetch(url + "/v1/messages", {
    method: "POST",
    headers: {"x-api-key": key, "anthropic-version": "2023-06-01",
              "anthropic-dangerous-direct-browser-access": "true",
              "content-type": "application/json"},
    body: JSON.stringify(body),
  });
  return {status: response.status, requestId: response.headers.get("request-id"),
          body: await response.json()};
}"""

#: a completion without a key (a keyless server), or the error the browser gives the page
COMPLETE = """async ({url, body}) => {
  try {
    const response = await fetch(url + "/v1/completions", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify(body),
    });
    return {status: response.status, body: await response.json()};
  } catch (error) {
    return {error: String(error)};
  }
}"""


@dataclass
class Setup:
    live: LiveServer
    browser: Any
    #: where the pages are served (any host name maps to it)
    page_port: int
    keyed: str
    keyless: str

    def origin(self, name: str) -> str:
        return f"http://{name}.test:{self.page_port}"


async def _page(request: web.Request) -> web.Response:
    html = "<!doctype html><title>a web app</title><pre id=out>waiting</pre>"
    return web.Response(text=html, content_type="text/html")


@pytest.fixture(scope="module")
def setup(embedded_model_dir: Path) -> Iterator[Setup]:
    from playwright.sync_api import sync_playwright

    live = LiveServer(embedded_model_dir, 1)
    try:
        pages = web.Application()
        pages.router.add_get("/", _page)
        page_port = int(live.serve(pages).rsplit(":", 1)[1])
        allowed = [f"http://app.test:{page_port}"]
        keyed = live.serve(api_app(live.backend, api_key=KEY, alias=MODEL, cors_origins=allowed))
        keyless = live.serve(api_app(live.backend, alias=MODEL, cors_origins=allowed))
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                yield Setup(live, browser, page_port, keyed, keyless)
            finally:
                browser.close()
    finally:
        live.stop()


def run_on_page(
    setup: Setup, name: str, script: str, argument: dict[str, Any], artifacts: Path
) -> tuple[Any, list[str]]:
    """``script`` run on a page of ``http://<name>.test``: its result and the console's
    lines, both written (with a screenshot of the result) under ``artifacts``."""
    context = setup.browser.new_context()
    try:
        page = context.new_page()
        console: list[str] = []
        page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
        page.goto(setup.origin(name) + "/")
        result = page.evaluate(script, argument)
        shown = json.dumps(result, indent=2)
        page.evaluate("text => { document.getElementById('out').textContent = text; }", shown)
        page.wait_for_timeout(200)  # the console's last lines
        artifacts.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(artifacts / f"{name}.png"), full_page=True)
        (artifacts / f"{name}-console.log").write_text("\n".join(console) + "\n")
        return result, console
    finally:
        context.close()


def caught(script: str) -> str:
    """``script`` answering the error the browser gives the page instead of raising it."""
    return (
        f"async (a) => {{ try {{ return await ({script})(a); }} "
        "catch (error) { return {error: String(error)}; } }"
    )


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0,
            **extra}  # fmt: skip


def test_a_listed_origins_page_streams_a_chat_completion(setup: Setup, tmp_path: Path) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    status, unstreamed = post(setup.keyed, "/v1/chat/completions", chat_body(), headers=headers)
    assert status == 200, unstreamed
    argument = {"url": setup.keyed, "key": KEY, "body": chat_body()}
    result, console = run_on_page(setup, "app", STREAM_CHAT, argument, tmp_path)
    assert result["status"] == 200 and result["type"].startswith("text/event-stream")
    assert result["last"] == "[DONE]" and result["events"] > 2
    assert result["text"] == unstreamed["choices"][0]["message"]["content"] != ""
    assert result["requestId"].startswith("req-")  # exposed: the page may read it
    assert not [line for line in console if CORS_BLOCKED in line]
    assert (tmp_path / "app.png").stat().st_size > 0


def test_a_listed_origins_page_gets_an_anthropic_message(setup: Setup, tmp_path: Path) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, "temperature": 0}
    argument = {"url": setup.keyed, "key": KEY, "body": body}
    result, _ = run_on_page(setup, "app", MESSAGE, argument, tmp_path)
    assert result["status"] == 200, result
    assert result["body"]["type"] == "message" and result["body"]["content"][0]["text"]
    assert result["requestId"].startswith("req-")


def test_without_a_key_the_listed_origin_passes_the_same_origin_check(
    setup: Setup, tmp_path: Path
) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0}  # fmt: skip
    result, _ = run_on_page(setup, "app", COMPLETE, {"url": setup.keyless, "body": body}, tmp_path)
    assert result["status"] == 200, result
    assert result["body"]["choices"][0]["text"]


@pytest.mark.parametrize("server", ["keyed", "keyless"])
def test_an_unlisted_origins_page_is_blocked(setup: Setup, tmp_path: Path, server: str) -> None:
    url = getattr(setup, server)
    argument = {"url": url, "key": KEY, "body": chat_body()}
    result, console = run_on_page(setup, "evil", caught(STREAM_CHAT), argument, tmp_path / server)
    assert result == {"error": "TypeError: Failed to fetch"}
    blocked = [line for line in console if CORS_BLOCKED in line]
    assert blocked, console
    assert f"from origin '{setup.origin('evil')}'" in blocked[0]
    assert "Response to preflight request doesn't pass access control check" in blocked[0]

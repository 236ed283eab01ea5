"""The built-in chat page in a real headless browser (Debian's chromium driven by Playwright)."""

from __future__ import annotations

import shutil

import pytest

from edgeserve.server import ServerConfig
from server_helpers import serve
from tiny_gguf import write_tiny_llama

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def _browser_or_skip():
    if not shutil.which("chromium"):
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium; .ci/run installs it)")
    import playwright.sync_api  # in the test extras: a broken install fails here

    return playwright.sync_api


def test_chat_page_streams_a_reply_multi_turn(tmp_path):
    pw = _browser_or_skip()
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    with serve(ServerConfig(kv_cache_gb=0.01, models=(str(path),), keep_alive=None)) as s, pw.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page()
            requests = []
            page.on("request", lambda r: requests.append(r.post_data) if r.url.endswith("/chat/completions") else None)
            page.goto(s.url + "/")
            page.wait_for_function("document.querySelectorAll('#model option').length > 0")
            assert page.locator("#model option").first.text_content() == "tiny"
            page.fill("#system", "You are terse.")
            page.fill("#maxtokens", "8")
            page.fill("#input", "hello there")
            page.press("#input", "Enter")
            page.wait_for_selector(".msg.user")
            assert page.locator(".msg.user").first.text_content() == "hello there"
            # streamed text appears in the assistant bubble, then the send button comes back
            page.wait_for_function("document.querySelector('.msg.assistant') && "
                                   "document.querySelector('.msg.assistant').textContent.length > 0", timeout=30000)
            page.wait_for_selector("#send:not(.hidden)", timeout=30000)
            first_reply = page.locator(".msg.assistant").first.text_content()
            assert first_reply
            # a second turn sends the whole history with the system prompt
            page.fill("#input", "and again")
            page.press("#input", "Enter")
            page.wait_for_function("document.querySelectorAll('.msg.assistant').length == 2")
            page.wait_for_selector("#send:not(.hidden)", timeout=30000)
            import json
            body = json.loads(requests[-1])
            assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
            assert body["messages"][2]["content"] == first_reply and body["stream"] is True
            assert body["max_tokens"] == 8
            assert page.locator(".msg.error").count() == 0
        finally:
            browser.close()


def test_chat_page_is_served(tmp_path):
    import httpx

    path = write_tiny_llama(tmp_path / "tiny.gguf")
    with serve(ServerConfig(kv_cache_gb=0.01, models=(str(path),), api_key="k")) as s:
        r = httpx.get(s.url + "/")  # the page itself needs no key; its API calls do
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]
        for needle in ("/v1/chat/completions", "/v1/models", 'id="stop"', 'id="system"', "getReader"):
            assert needle in r.text
        assert "http://" not in r.text and "https://" not in r.text  # no CDN

"""The built-in chat page in a real headless browser (Debian's chromium driven by Playwright).

Most tests answer /v1/chat/completions from inside the browser with a scripted OpenAI-style SSE stream (so the
reply is known); the multi-turn and cold-load tests talk to a real server running a tiny random-weight GGUF.
Screenshots at desktop and phone width go to $EDGESERVE_TEST_OUTPUT/chat_page (default: test-output/ at the repo root).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

from edgeserve.server import ServerConfig
from edgeserve.engine.config import EngineConfig
from server_helpers import serve, serve_tiny
from tiny_gguf import write_tiny_llama

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
OUTPUT = Path(os.environ.get("EDGESERVE_TEST_OUTPUT", Path(__file__).resolve().parents[2] / "test-output")) / "chat_page"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
IDLE = "#send:not(.hidden)"  # the send button is back: no reply is being generated

MARKDOWN_REPLY = """## Squares

Here is a **function** and a table:

- one
- two

| n | n squared |
|---|---|
| 2 | 4 |

```python
def square(x):
    return x * x
```

Use `square(3)` inline."""

EVIL_REPLY = """<script>window.__pwned = "script"</script>

<img src="nope.png" onerror="window.__pwned = 'onerror'">

Inline <img src=x onerror="window.__pwned='inline'"> too.

[click](javascript:void(window.__pwned='link')) and ![pic](nope.png" onerror="window.__pwned='attr')

```html
<img src=x onerror="window.__pwned='code'">
```"""


def _chromium_or_skip():
    if not shutil.which("chromium"):
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium; .ci/run installs it)")
    import playwright.sync_api  # in the test extras: a broken install fails here

    return playwright.sync_api


def expect(locator):
    """Playwright's auto-waiting assertions (imported late: the module skips without playwright)."""
    from playwright.sync_api import expect as pw_expect

    return pw_expect(locator)


@pytest.fixture(scope="module")
def browser():
    pw = _chromium_or_skip()
    with pw.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, browser):
    with serve_tiny(tmp_path_factory.mktemp("chat_page")) as s:
        yield s


def _sse(reply: str, chunk: int = 4) -> tuple[str, int]:
    """An OpenAI chat-completions stream of `reply` in small deltas, then usage; returns (body, completion_tokens)."""
    base = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": "tiny"}
    pieces = [reply[i:i + chunk] for i in range(0, len(reply), chunk)]
    events = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    events += [{**base, "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces]
    events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events.append({**base, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": len(pieces),
                                                     "total_tokens": 5 + len(pieces)}})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n", len(pieces)


def _scripted(page, reply_for):
    """Answer the page's chat requests with reply_for(request_body, call_number); returns the request bodies."""
    bodies: list[dict] = []

    def handle(route):
        body = json.loads(route.request.post_data)
        bodies.append(body)
        text, _ = _sse(reply_for(body, len(bodies)))
        route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=text)

    page.route("**/v1/chat/completions", handle)
    return bodies


@contextlib.contextmanager
def _context(browser, **context_args):
    """A new browser context, closed on leaving."""
    context = browser.new_context(**context_args)
    try:
        yield context
    finally:
        context.close()


@contextlib.contextmanager
def _open(browser, url, **context_args):
    """The chat page at `url`, loaded in a new context (closed on leaving); yields (page, its script errors and
    Content-Security-Policy violations)."""
    with _context(browser, **context_args) as context:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)
        page.goto(url + "/")
        page.wait_for_selector("#model option", state="attached")
        yield page, errors


def _send(page, text):
    page.fill("#input", text)
    page.press("#input", "Enter")
    page.wait_for_selector(IDLE, timeout=30000)


def _turns(page):
    """The conversation on screen as (role, text) pairs."""
    return [(t.get_attribute("class").split()[1], t.locator(".msg").text_content().strip())
            for t in page.locator("#log .turn").all()]


def test_chat_page_is_served(tmp_path):
    import httpx

    path = write_tiny_llama(tmp_path / "tiny.gguf")
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(path),), api_key="k")) as s:
        r = httpx.get(s.url + "/")  # the page and its files need no key; its API calls do
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]
        assert "script-src 'self'" in r.headers["content-security-policy"]
        for needle in ('id="stop"', 'id="system"', 'id="top_p"', 'id="chats"', "/static/chat.js"):
            assert needle in r.text
        js = httpx.get(s.url + "/static/chat.js")
        assert js.status_code == 200 and "javascript" in js.headers["content-type"]
        for needle in ("/v1/chat/completions", "/v1/models", "/api/ps", "include_usage", "getReader", "localStorage"):
            assert needle in js.text
        for f in ("chat.css", "vendor/marked.umd.js", "vendor/purify.min.js", "vendor/highlight/core.min.js",
                  "vendor/highlight/languages/python.min.js", "vendor/highlight/github-dark.min.css",
                  "vendor/LICENSE.marked", "vendor/LICENSE.dompurify", "vendor/highlight/LICENSE"):
            assert httpx.get(f"{s.url}/static/{f}").status_code == 200, f
        for text in (r.text, js.text, httpx.get(s.url + "/static/chat.css").text):
            assert "http://" not in text and "https://" not in text  # no CDN
        missing = httpx.get(s.url + "/static/nope.js")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_chat_page_streams_a_reply_multi_turn(browser, server):
    with _open(browser, server.url) as (page, errors):
        requests = []
        page.on("request", lambda r: requests.append(r.post_data) if r.url.endswith("/chat/completions") else None)
        assert page.locator("#model option").first.get_attribute("value") == "tiny"
        page.click("#open-settings")
        page.fill("#system", "You are terse.")
        page.fill("#maxtokens", "8")
        page.click("#settings-done")
        _send(page, "hello there")
        assert _turns(page)[0] == ("user", "hello there")
        assert page.locator(".msg.assistant").text_content()
        _send(page, "and again")
        assert page.locator(".msg.assistant").count() == 2
        body = json.loads(requests[-1])
        assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
        stored = page.evaluate("JSON.parse(localStorage.getItem('edgeserve-chats'))")
        (chat,) = stored.values()
        assert body["messages"][2]["content"] == chat["messages"][1]["content"] != ""
        assert body["stream"] is True and body["max_tokens"] == 8 and body["stream_options"] == {"include_usage": True}
        # the real server's usage chunk gives the token count under the reply
        assert page.locator(".turn.assistant .meta .tokens").first.text_content() == \
            f"{chat['messages'][1]['meta']['tokens']} tokens"
        assert page.locator(".msg.error").count() == 0 and not errors
        assert page.locator("#model option").first.text_content() == "tiny \u00b7 loaded"


def test_streamed_markdown_is_rendered_with_highlighted_code_and_a_copy_button(browser, server):
    with _open(browser, server.url, permissions=["clipboard-read", "clipboard-write"]) as (page, errors):
        _scripted(page, lambda body, n: MARKDOWN_REPLY)
        _send(page, "show me squares")
        reply = page.locator(".msg.assistant")
        assert reply.locator("h2").text_content() == "Squares"
        assert reply.locator("li").all_text_contents() == ["one", "two"]
        assert reply.locator("td").all_text_contents() == ["2", "4"]
        assert reply.locator("p code").text_content() == "square(3)"
        code = reply.locator(".code pre code.hljs")
        assert code.text_content().strip() == "def square(x):\n    return x * x"
        assert code.locator(".hljs-keyword").all_text_contents()[:2] == ["def", "return"]
        reply.locator(".code .copy").click()
        expect(reply.locator(".code .copy")).to_have_text("Copied")
        assert page.evaluate("navigator.clipboard.readText()").strip() == "def square(x):\n    return x * x"
        _, tokens = _sse(MARKDOWN_REPLY)
        meta = page.locator(".turn.assistant .meta")
        assert meta.locator(".tokens").text_content() == f"{tokens} tokens"
        assert re.fullmatch(r"[\d.]+ tok/s", meta.locator(".tps").text_content())
        assert re.fullmatch(r"first token [\d.]+ s", meta.locator(".ttft").text_content())
        assert meta.locator(".stopped").count() == 0 and not errors


def test_script_in_model_output_never_runs(browser, server):
    # with the page's Content-Security-Policy switched off, so the escaping and DOMPurify alone must hold
    with _open(browser, server.url, bypass_csp=True) as (page, errors):
        _scripted(page, lambda body, n: EVIL_REPLY)
        _send(page, "be evil")
        reply = page.locator(".msg.assistant")
        reply.locator(".code").wait_for()
        reply.locator("a", has_text="click").click()
        # an <img> that failed to load has fired its error event by the time the window's load event has
        page.evaluate("new Promise((r) => document.readyState === 'complete' ? setTimeout(r, 0) : onload = r)")
        page.evaluate("Promise.all([...document.images].map((i) => i.decode().catch(() => null)))")
        assert page.evaluate("window.__pwned") is None
        assert "<script>window.__pwned" in reply.text_content()  # shown as text, not run
        assert reply.locator("script, [onerror], a[href^='javascript']").count() == 0


def test_reload_keeps_the_conversation_and_edit_or_regenerate_replaces_the_reply(browser, server):
    with _open(browser, server.url) as (page, errors):
        bodies = _scripted(page, lambda body, n: f"reply {n} to *{body['messages'][-1]['content']}*")
        _send(page, "first question")
        _send(page, "second question")
        page.reload()
        page.wait_for_selector("#log .turn")
        before = [("user", "first question"), ("assistant", "reply 1 to first question"),
                  ("user", "second question"), ("assistant", "reply 2 to second question")]
        assert _turns(page) == before
        assert page.locator("#chats li").all_text_contents()[0].startswith("first question")
        assert page.locator(".msg.assistant em").first.text_content() == "first question"  # markdown after reload
        # edit the first message: everything after it is replaced by the new reply
        page.locator(".turn.user").first.locator("button.edit").click()
        page.fill(".edit-box textarea", "edited question")
        page.press(".edit-box textarea", "Enter")
        page.wait_for_selector(IDLE)
        assert _turns(page) == [("user", "edited question"), ("assistant", "reply 3 to edited question")]
        assert [m["content"] for m in bodies[-1]["messages"]] == ["edited question"]
        # regenerate the last reply
        page.locator(".turn.assistant button.regenerate").click()
        page.wait_for_selector(IDLE)
        assert _turns(page) == [("user", "edited question"), ("assistant", "reply 4 to edited question")]
        page.reload()
        page.wait_for_selector("#log .turn")
        assert _turns(page)[-1] == ("assistant", "reply 4 to edited question")
        # a new chat, a rename, switching back, deleting
        page.click("#new-chat")
        assert _turns(page) == []
        _send(page, "another chat")
        assert page.locator("#chats li").count() == 2
        page.locator("#chats li", has_text="another chat").locator(".rename").click()
        page.fill("#chats li input", "Renamed")
        page.press("#chats li input", "Enter")
        assert page.locator("#chat-title").text_content() == "Renamed"
        page.locator("#chats li", has_text="first question").locator(".open").click()  # named by its first message
        assert _turns(page)[0] == ("user", "edited question")
        page.once("dialog", lambda d: d.accept())
        page.locator("#chats li", has_text="Renamed").hover()  # its buttons show on hover or keyboard focus
        page.locator("#chats li", has_text="Renamed").locator(".delete").click()
        assert page.locator("#chats li .open").all_text_contents() == ["first question"]
        assert not errors


def test_an_error_is_shown_in_the_reply_and_left_out_of_the_history(browser, server):
    with _open(browser, server.url) as (page, errors):
        bodies = []

        def handle(route):
            bodies.append(json.loads(route.request.post_data))
            if len(bodies) == 1:
                route.fulfill(status=400, json={"error": {"message": "prompt too long", "type": "invalid_request_error",
                                                          "param": "messages", "code": "context_length_exceeded"}})
            else:
                route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=_sse("fine")[0])

        page.route("**/v1/chat/completions", handle)
        _send(page, "first")
        assert page.locator(".msg.assistant.error").text_content() == "error: prompt too long"
        _send(page, "second")
        assert [m["content"] for m in bodies[-1]["messages"]] == ["first", "second"]
        assert _turns(page)[-1] == ("assistant", "fine") and not errors


def test_keyboard_only_chat_and_export(browser, server):
    with _open(browser, server.url, accept_downloads=True) as (page, errors):
        _scripted(page, lambda body, n: "# Title\n\nsome `code`")
        page.keyboard.type("line one")  # the message box has focus on load
        page.keyboard.press("Shift+Enter")
        page.keyboard.type("line two")
        page.keyboard.press("Enter")
        page.wait_for_selector(IDLE)
        assert _turns(page) == [("user", "line one\nline two"), ("assistant", "Title\nsome code")]
        page.focus("#menu summary")
        page.keyboard.press("Enter")
        with page.expect_download() as md:
            page.locator("#export-md").focus()
            page.keyboard.press("Enter")
        text = Path(md.value.path()).read_text()
        assert text == "# line one line two\n\n**User**\n\nline one\nline two\n\n**Assistant**\n\n# Title\n\nsome `code`\n"
        with page.expect_download() as js:
            page.click("#menu summary")
            page.click("#export-json")
        exported = json.loads(Path(js.value.path()).read_text())
        assert [(m["role"], m["content"]) for m in exported["messages"]] == [
            ("user", "line one\nline two"), ("assistant", "# Title\n\nsome `code`")]
        assert exported["messages"][1]["meta"]["tokens"] == _sse("# Title\n\nsome `code`")[1]
        assert not errors


def test_cold_load_shows_loading_then_stop_marks_the_reply(browser, tmp_path, monkeypatch):
    import edgeserve.models.load as load_module

    gate = threading.Event()
    real_load = load_module.load_model

    def gated_load(*args, **kwargs):
        gate.wait(timeout=60)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(load_module, "load_model", gated_load)
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    with serve(ServerConfig(engine=EngineConfig(kv_cache_gb=0.01), models=(str(path),), keep_alive=None)) as s:
        with _open(browser, s.url) as (page, errors):
            try:
                assert page.locator("#model option").first.text_content() == "tiny \u00b7 not loaded"
                page.fill("#input", "hello")
                page.press("#input", "Enter")
                expect(page.locator(".msg.assistant .status")).to_have_text(
                    re.compile(r"loading model tiny\u2026 \d+ s"))
                expect(page.locator("#model option").first).to_have_text("tiny \u00b7 loading")
                OUTPUT.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(OUTPUT / "desktop-loading.png"))
                page.click("#stop")
                page.wait_for_selector(IDLE)
                assert page.locator(".turn.assistant .meta .stopped").text_content() == "stopped"
                gate.set()
                page.locator(".turn.assistant button.regenerate").click()
                page.wait_for_selector(IDLE, timeout=30000)
                meta = page.locator(".turn.assistant .meta")
                assert meta.locator(".stopped").count() == 0 and meta.locator(".tokens").count() == 1
                assert page.locator(".turn.assistant").count() == 1 and not errors
            finally:
                gate.set()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_screenshots_at_desktop_and_phone_width(browser, server, scheme):
    OUTPUT.mkdir(parents=True, exist_ok=True)
    for name, viewport in (("desktop", {"width": 1280, "height": 800}), ("phone", {"width": 390, "height": 844})):
        with _open(browser, server.url, viewport=viewport, color_scheme=scheme,
                   is_mobile=name == "phone", has_touch=name == "phone") as (page, errors):
            _scripted(page, lambda body, n: MARKDOWN_REPLY if n == 1 else "Sure. **Short** answer.")
            _send(page, "show me squares")
            _send(page, "thanks!")
            page.click("#new-chat" if name == "desktop" else "#new-chat-top")
            _send(page, "a second conversation")
            if name == "phone":
                page.click("#toggle-sidebar")
            page.locator("#chats li .open").last.click()
            assert page.locator(".code .copy").is_visible()
            box = page.locator(".msg.user").first.bounding_box()
            assert box["width"] < viewport["width"] * 0.6  # a short message does not stretch
            assert page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]  # nothing sideways
            page.screenshot(path=str(OUTPUT / f"{name}-{scheme}.png"))
            if name == "phone":
                assert not page.locator("#sidebar").is_visible()
                page.click("#toggle-sidebar")
                expect(page.locator("#sidebar")).to_have_css("transform", "none")
                assert page.locator("#chats li").count() == 2
                page.screenshot(path=str(OUTPUT / f"{name}-{scheme}-list.png"))
                page.keyboard.press("Escape")
            page.click("#open-settings" if name == "desktop" else "#menu summary")
            if name == "phone":
                page.click("#settings-from-menu")
            page.wait_for_selector("#settings[open]")
            page.screenshot(path=str(OUTPUT / f"{name}-{scheme}-settings.png"))
            assert not errors


@contextlib.contextmanager
def _open_listing(browser, url, model_id, **context_args):
    """The page with /v1/models and /api/ps answered in the browser: one model `model_id`, not loaded; yields
    (page, its script errors), the context closed on leaving."""
    with _context(browser, **context_args) as context:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.route("**/v1/models", lambda r: r.fulfill(json={"object": "list", "data": [{"id": model_id,
                                                                                           "object": "model"}]}))
        page.route("**/api/ps", lambda r: r.fulfill(json={"models": []}))
        page.goto(url + "/")
        page.wait_for_selector("#model option", state="attached")
        yield page, errors


def test_the_first_screen_shows_the_model_its_state_and_example_prompts(browser, server):
    with _open(browser, server.url) as (page, errors):
        expect(page.locator("#empty-model")).to_have_text("tiny")
        state = page.locator("#model option").first.text_content().split(" \u00b7 ")[1]
        assert page.locator("#empty-state").text_content().startswith(state)
        assert page.locator("#empty-note").is_hidden()  # the note is about the tiny default model only
        OUTPUT.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(OUTPUT / "desktop-first-screen.png"))
        examples = page.locator("#examples .example")
        assert examples.count() == 4 and examples.first.is_visible()
        bodies = _scripted(page, lambda body, n: "a reply")
        prompt = examples.nth(1).text_content().strip()
        examples.nth(1).click()
        page.wait_for_selector(IDLE)
        assert _turns(page)[0] == ("user", prompt) and bodies[0]["messages"][-1]["content"] == prompt
        assert page.locator("#empty").is_hidden() and not errors
    with _open_listing(browser, server.url, "smollm2-135m") as (page, errors):
        expect(page.locator("#empty-state")).to_have_text("not loaded: it loads with your first message")
        note = page.locator("#empty-note")
        assert "135M model" in note.text_content() and "edgeserve pull qwen2.5-1.5b" in note.text_content()


FITS = """([selector, text, reserve]) => {
  const el = document.querySelector(selector), cs = getComputedStyle(el);
  const ctx = document.createElement("canvas").getContext("2d");
  ctx.font = `${cs.fontStyle} ${cs.fontWeight} ${cs.fontSize} ${cs.fontFamily}`;
  const room = el.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight) - reserve;
  return [ctx.measureText(text).width, room];
}"""


def test_at_phone_width_the_placeholder_and_the_model_name_are_whole(browser, server):
    with _open_listing(browser, server.url, "smollm2-135m", viewport={"width": 390, "height": 844},
                       is_mobile=True, has_touch=True) as (page, errors):
        placeholder = page.locator("#input").get_attribute("placeholder")
        width, room = page.evaluate(FITS, ["#input", placeholder, 0])
        assert width <= room, f"the placeholder {placeholder!r} needs {width:.0f}px, has {room:.0f}px"
        label = page.locator("#model option").first.text_content()
        assert label == "smollm2-135m \u00b7 not loaded"
        width, room = page.evaluate(FITS, ["#model", label, 24])  # 24 px: the select's arrow
        assert width <= room, f"the model picker needs {width:.0f}px for {label!r}, has {room:.0f}px"
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        assert page.locator("header").bounding_box()["y"] == 0  # no empty band above it (the hidden scrim)
        OUTPUT.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(OUTPUT / "phone-first-screen.png"))


def test_a_long_first_message_names_the_chat_with_an_ellipsis(browser, server):
    with _open(browser, server.url) as (page, errors):
        _scripted(page, lambda body, n: "ok")
        text = "Please summarise the following meeting notes for me in three short bullet points"
        _send(page, text)
        title = page.locator("#chat-title").text_content()
        assert len(title) == 48 and title.endswith("\u2026") and text.startswith(title[:-1].rstrip())
        assert page.locator("#chats li .open").first.text_content() == title


def test_empty_settings_leave_the_fields_to_the_server(browser, server):
    with _context(browser) as context:
        # what the first version of the page stored: its prefilled 0.7 and 1024, which the user never chose
        context.add_init_script("if (!localStorage.getItem('edgeserve-settings')) localStorage.setItem("
                                "'edgeserve-settings', JSON.stringify({temperature: '0.7', max_tokens: '1024'}))")
        page = context.new_page()
        page.goto(server.url + "/")
        page.wait_for_selector("#model option", state="attached")
        bodies = _scripted(page, lambda body, n: "ok")
        page.click("#open-settings")
        assert "Empty fields use the server's defaults" in page.locator("#settings .hint").text_content()
        for field in ("#temperature", "#top_p", "#maxtokens"):
            assert page.input_value(field) == "", field
        page.click("#settings-done")
        _send(page, "hello")
        assert not {"temperature", "top_p", "max_tokens"} & set(bodies[0])


def test_regenerate_keeps_both_replies_switchable(browser, server):
    with _open(browser, server.url) as (page, errors):
        bodies = _scripted(page, lambda body, n: f"reply {n}")
        _send(page, "question")
        page.locator(".turn.assistant button.regenerate").click()
        page.wait_for_selector(IDLE)
        assert _turns(page) == [("user", "question"), ("assistant", "reply 2")]
        assert page.locator(".turn.assistant .version").text_content() == "2/2"
        page.locator(".turn.assistant button.prev-version").click()
        assert _turns(page)[-1] == ("assistant", "reply 1")
        assert page.locator(".turn.assistant .version").text_content() == "1/2"
        assert page.locator(".turn.assistant button.prev-version").is_disabled()
        OUTPUT.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(OUTPUT / "desktop-reply-versions.png"))
        page.reload()
        page.wait_for_selector("#log .turn")
        assert _turns(page)[-1] == ("assistant", "reply 1")  # the choice is kept
        _send(page, "follow-up")  # the history sent is the reply on screen
        assert [m["content"] for m in bodies[-1]["messages"]] == ["question", "reply 1", "follow-up"]
        assert page.locator(".version").count() == 0  # only the last reply switches
        assert not errors


def test_an_attached_image_is_sent_as_an_image_part_and_shown_in_the_conversation(browser, server, tmp_path):
    from vision_helpers import picture

    (tmp_path / "cat.png").write_bytes(picture(24, 16, seed=7))
    with _open(browser, server.url) as (page, errors):
        bodies = _scripted(page, lambda body, n: "a picture")
        page.set_input_files("#file", str(tmp_path / "cat.png"))
        expect(page.locator("#attachments .thumb")).to_have_count(1)
        _send(page, "what is this?")
        parts = bodies[0]["messages"][-1]["content"]
        assert parts[0] == {"type": "text", "text": "what is this?"}
        assert parts[1]["type"] == "image_url" and parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
        expect(page.locator("#attachments .thumb")).to_have_count(0)  # sent: the next message starts without it
        expect(page.locator("#log .turn.user img.attached")).to_have_count(1)
        _send(page, "and now?")  # the image stays in the history the next turn sends
        assert bodies[1]["messages"][0]["content"][1] == parts[1] and bodies[1]["messages"][-1]["content"] == "and now?"
        page.reload()
        expect(page.locator("#log .turn.user img.attached")).to_have_count(1)
        assert not errors, errors


def test_settings_show_the_models_recommended_sampling(browser, server):
    with _context(browser) as context:
        page = context.new_page()
        shown = []

        def show(route):
            shown.append(json.loads(route.request.post_data)["model"])
            route.fulfill(status=200, headers={"content-type": "application/json"},
                          body=json.dumps({"parameters": "num_ctx 128\ntemperature 0.6\ntop_p 0.95"}))

        page.route("**/api/show", show)
        page.goto(server.url + "/")
        page.wait_for_selector("#model option", state="attached")
        expect(page.locator("#temperature")).to_have_attribute("placeholder", "model's: 0.6")
        expect(page.locator("#top_p")).to_have_attribute("placeholder", "model's: 0.95")
        assert shown == ["tiny"]
        assert page.locator("#attach svg").count() == 1  # an icon that needs no emoji font

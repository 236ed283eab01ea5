"""What real clients (OpenAI Agents SDK, instructor, pydantic-ai, ollama-python, Open WebUI) send and need, on the
tiny scripted models of test_tool_templates.py: a forced tool call beside a response format, a forced call cut by
max_tokens, tool_choice "required" bounded, Ollama logprobs, /api/ps context_length, Ollama's 400 for thinking on a
model that cannot think, and OpenAI's allowed_tools (issue 34, section 2)."""

from __future__ import annotations

import json

import httpx
import pytest

from server_helpers import serve_scripted, server_fixture

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
R_TOOLS = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
A_TOOLS = [{"name": "get_weather", "input_schema": SCHEMA}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
GREEDY = {"temperature": 0, "top_k": 1}


server = server_fixture(serve_scripted, "clients")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def sse(r: httpx.Response) -> list[dict]:
    """The JSON data of every SSE event of a streamed reply (without [DONE])."""
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


# --- 1. a forced tool call beside a response format -------------------------------------------------------------

def test_forced_call_with_response_format_is_accepted_on_chat(http):
    body = {"model": "tooly", "messages": ASK, "tools": TOOLS, "max_tokens": 30, **GREEDY,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": ANSWER_SCHEMA}}}
    choice = ok(http.post("/v1/chat/completions", json=body))["choices"][0]
    (call,) = choice["message"]["tool_calls"]  # the tool choice governs this turn, not the format
    assert call["function"]["name"] == "get_weather"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])  # Agents SDK, instructor
def test_forced_call_with_text_format_is_accepted_on_responses(http, choice):
    body = {"model": "tooly", "input": "Weather in Paris?", "tools": R_TOOLS, "tool_choice": choice,
            "max_output_tokens": 30, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "out", "schema": ANSWER_SCHEMA}}}
    out = ok(http.post("/v1/responses", json=body))["output"]
    assert [o["name"] for o in out if o["type"] == "function_call"] == ["get_weather"]


def test_forced_call_with_output_format_is_accepted_on_anthropic(http):
    body = {"model": "tooly", "messages": ASK, "tools": A_TOOLS, "tool_choice": {"type": "any"}, "max_tokens": 30,
            "temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}}}
    content = ok(http.post("/v1/messages", json=body))["content"]
    assert [b["name"] for b in content if b["type"] == "tool_use"] == ["get_weather"]


# --- 2. a forced call cut by max_tokens is still a call ---------------------------------------------------------

# get_time is off the scripted model's path: it writes the hermes call byte by byte (greedy among equal logits:
# the lowest allowed token, a space inside the arguments' first key), 36 tokens up to the arguments, so 40 tokens
# cut it inside them
NAMED = {"model": "tooly", "messages": ASK, "tools": TOOLS, "max_tokens": 40, **GREEDY,
         "tool_choice": {"type": "function", "function": {"name": "get_time"}}}


def test_forced_call_cut_by_max_tokens_is_a_call_with_partial_arguments(http):
    choice = ok(http.post("/v1/chat/completions", json=NAMED))["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    args = call["function"]["arguments"]
    assert args.startswith("{") and "}" not in args  # what was generated: 4 tokens of the arguments object


def test_forced_call_cut_by_max_tokens_streams_as_a_call(http):
    chunks = sse(http.post("/v1/chat/completions", json={**NAMED, "stream": True}))
    calls = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    assert calls[0]["function"]["arguments"].startswith("{")
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks) == ""


def test_cut_required_reply_keeps_its_complete_calls():
    from edgeserve.server.chat_setup import ChatSetup
    from edgeserve.engine.outputs import RequestOutput
    from edgeserve.text.chat_output import ChatOutputParser, ToolSetup

    setup = ChatSetup("", None, False, False, ToolSetup("forced", known={"a", "b"}, parallel=True))
    parser = setup.parser()
    assert isinstance(parser, ChatOutputParser)
    text = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"y')
    out = RequestOutput(request_id="r", text=text, token_ids=[1], logprobs=None, finish_reason="length")
    setup.split(parser, out)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("a", '{"x": 1}'), ("b", '{"y')]
    assert out.text == "" and out.finish_reason == "length"


# --- 3. tool_choice "required" is bounded -----------------------------------------------------------------------

@pytest.mark.parametrize("parallel,most", [(None, 1), (False, 1), (True, 16)])
def test_required_allows_one_call_unless_parallel(server, http, parallel, most):
    from edgeserve.server.api.openai import parse_chat_request
    from edgeserve.server.chat_setup import MAX_PARALLEL_CALLS, chat_setup
    from edgeserve.text.grammar import GrammarCompiler, allowed_mask

    ok(http.post("/api/generate", json={"model": "tooly"}))  # loaded
    body = {"model": "tooly", "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    lm = server.manager.entries["tooly"].lm
    setup = chat_setup(parse_chat_request(body, 1), lm.chat_template)
    compiler = GrammarCompiler.for_tokenizer(lm.tokenizer, lm.tokenizer.vocab_size)
    block = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    for n, allowed in ((most, True), (most + 1, False)):  # the hermes grammar's own bound
        state = compiler.start(setup.constraint)
        ids = lm.tokenizer.encode("\n".join([block] * n), add_special_tokens=False)
        assert all(allowed_mask([state], compiler.vocab_size)[0, t] and state.accept([t]) for t in ids) == allowed
    assert MAX_PARALLEL_CALLS == 16


def test_required_reply_ends_within_its_bound(http):
    body = {"model": "tooly", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 400,
            **GREEDY}
    choice = ok(http.post("/v1/chat/completions", json=body))["choices"][0]
    assert len(choice["message"]["tool_calls"] or []) == 1


# --- 4. Ollama logprobs ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
def test_ollama_logprobs_in_ollamas_shape(http, path):
    body = {"model": "thinky", "stream": False, "logprobs": True, "top_logprobs": 2,
            "options": {"temperature": 0, "num_predict": 4}}
    body.update({"messages": ASK} if path == "/api/chat" else {"prompt": "hi"})
    r = ok(http.post(path, json=body))
    lps = r["logprobs"]
    assert len(lps) == r["eval_count"] > 0
    for lp in lps:
        assert isinstance(lp["token"], str) and lp["logprob"] <= 0 and bytes(lp["bytes"]).decode() == lp["token"]
        assert len(lp["top_logprobs"]) == 2 and lp["top_logprobs"][0]["logprob"] >= lp["top_logprobs"][1]["logprob"]
    lines = [json.loads(x) for x in http.post(path, json={**body, "stream": True}).text.splitlines()]
    assert [lp["token"] for x in lines for lp in x.get("logprobs", [])] == [lp["token"] for lp in lps]
    plain = ok(http.post(path, json={**body, "logprobs": False, "top_logprobs": 0}))
    assert "logprobs" not in plain


def test_ollama_top_logprobs_needs_logprobs(http):
    r = http.post("/api/chat", json={"model": "thinky", "messages": ASK, "top_logprobs": 2})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]


# --- 5. /api/ps context_length, think on a model that cannot think, allowed_tools ------------------------------

def test_ps_reports_context_length(server, http):
    ok(http.post("/api/generate", json={"model": "tooly"}))
    (entry,) = [m for m in ok(http.get("/api/ps"))["models"] if m["name"] == "tooly"]
    assert entry["context_length"] == server.manager.entries["tooly"].engine.max_model_len > 0


@pytest.mark.parametrize("think", [True, "high"])
def test_ollama_think_on_a_model_that_cannot_think_is_400(http, think):
    for path, extra in (("/api/chat", {"messages": ASK}), ("/api/generate", {"prompt": "hi"})):
        r = http.post(path, json={"model": "tooly", "stream": False, "think": think, **extra})
        assert r.status_code == 400 and r.json() == {"error": '"tooly" does not support thinking'}, r.text
    body = {"stream": False, "messages": ASK, "options": {"num_predict": 2}}
    assert ok(http.post("/api/chat", json={"model": "tooly", "think": False, **body}))["done"]
    assert ok(http.post("/api/chat", json={"model": "thinky", "think": think, **body}))["done"]


def test_openai_allowed_tools(http):
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}
    body = {"model": "tooly", "messages": ASK, "tools": TOOLS, "tool_choice": allowed, "max_tokens": 30, **GREEDY}
    (call,) = ok(http.post("/v1/chat/completions", json=body))["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"  # the only tool it may call
    auto = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}
    msg = ok(http.post("/v1/chat/completions", json={**body, "tool_choice": auto}))["choices"][0]["message"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    responses = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}
    out = ok(http.post("/v1/responses", json={"model": "tooly", "input": "Weather?", "tools": R_TOOLS,
                                              "tool_choice": responses, "max_output_tokens": 30}))["output"]
    assert [o["name"] for o in out if o["type"] == "function_call"] == ["get_weather"]
    bad = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function",
                                                                                  "function": {"name": "nope"}}]}}
    r = http.post("/v1/chat/completions", json={**body, "tool_choice": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"

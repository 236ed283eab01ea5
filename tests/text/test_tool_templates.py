"""Tool calls and reasoning through a test-started server with the openai SDK, on tiny scripted models whose chat
templates are a Qwen-style tool template and a Qwen3-style thinking template (see scripted_gguf.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from scripted_gguf import ANSWER, THOUGHT
from server_helpers import serve_scripted, served_ids, server_fixture

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


server = server_fixture(serve_scripted, "scripted")


@pytest.fixture(scope="module")
def ids(server):
    return served_ids(server, "tooly", "thinky")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_auto_tool_call_is_parsed(client, ids):
    r = client.chat.completions.create(model=ids[0], messages=ASK, tools=TOOLS, temperature=0, max_tokens=20)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_auto_tool_call_streamed_reassembles(client, ids):
    stream = client.chat.completions.create(model=ids[0], messages=ASK, tools=TOOLS, temperature=0, max_tokens=20,
                                            stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]


def test_tool_choice_none_leaves_text(client, ids):
    r = client.chat.completions.create(model=ids[0], messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=20)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert "get_weather" in r.choices[0].message.content


def test_multi_turn_with_tool_message_renders_and_continues(client, ids, server):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    r = client.chat.completions.create(model=ids[0], messages=history, tools=TOOLS, temperature=0, max_tokens=20)
    assert r.choices[0].finish_reason == "tool_calls"
    lm = server.manager.entries[ids[0]].lm
    from edgeserve.server.chat_setup import chat_setup
    from edgeserve.server.api.openai import parse_chat_request

    prompt = chat_setup(parse_chat_request({"model": ids[0], "messages": history, "tools": TOOLS}, 1),
                        lm.chat_template).prompt
    assert '<tool_response>\n18 C, sunny\n</tool_response>' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '"name": "get_weather", "description": "Weather in a city"' in prompt  # the tools, by the template


def test_message_name_reaches_the_template(server, ids):
    from edgeserve.server.chat_setup import chat_setup
    from edgeserve.server.api.openai import parse_chat_request

    lm = server.manager.entries[ids[0]].lm
    req = parse_chat_request({"model": ids[0], "messages": [{"role": "user", "name": "alice", "content": "hi"}]}, 1)
    assert "<|im_start|>user name=alice\nhi" in chat_setup(req, lm.chat_template).prompt


def test_ollama_tools(server, ids):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/api/chat", json={"model": ids[0], "messages": ASK, "tools": TOOLS, "stream": False,
                                      "options": {"temperature": 0, "num_predict": 20}}).json()
    assert r["message"]["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert r["done_reason"] == "stop"


def test_reasoning_split(client, ids):
    r = client.chat.completions.create(model=ids[1], messages=ASK, temperature=0, max_tokens=20)
    msg = r.choices[0].message.model_dump()
    assert msg["content"] == ANSWER
    assert msg["reasoning_content"] == THOUGHT and msg["reasoning"] == THOUGHT


def test_reasoning_streamed(client, ids):
    stream = client.chat.completions.create(model=ids[1], messages=ASK, temperature=0, max_tokens=20, stream=True)
    content = reasoning = ""
    for chunk in stream:
        delta = chunk.choices[0].delta.model_dump()
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
    assert (reasoning, content) == (THOUGHT, ANSWER)


def test_enable_thinking_false(client, ids):
    r = client.chat.completions.create(model=ids[1], messages=ASK, temperature=0, max_tokens=20,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = r.choices[0].message.model_dump()
    assert msg["content"] == ANSWER and not msg.get("reasoning_content")


def test_ollama_think(server, ids):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        on = c.post("/api/chat", json={"model": ids[1], "messages": ASK, "think": True, "stream": False,
                                       "options": {"temperature": 0}}).json()
        off = c.post("/api/chat", json={"model": ids[1], "messages": ASK, "think": False, "stream": False,
                                        "options": {"temperature": 0}}).json()
        lines = [json.loads(x) for x in c.post("/api/chat", json={
            "model": ids[1], "messages": ASK, "think": True, "options": {"temperature": 0}}).text.splitlines()]
    assert (on["message"]["thinking"], on["message"]["content"]) == (THOUGHT, ANSWER)
    assert off["message"]["content"] == ANSWER and "thinking" not in off["message"]
    assert "".join(x["message"].get("thinking", "") for x in lines) == THOUGHT
    assert "".join(x["message"]["content"] for x in lines) == ANSWER


def test_structured_output_applies_after_reasoning(client, ids):
    # the scripted answer is not JSON: the grammar forbids it after </think>, so the reply is JSON instead
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat.completions.create(model=ids[1], messages=ASK, temperature=0, max_tokens=30,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": schema}})
    msg = r.choices[0].message.model_dump()
    assert msg.get("reasoning_content") == THOUGHT, msg
    assert set(json.loads(msg["content"])) == {"ok"}, msg


def test_bad_tool_fields_are_400(client, ids):
    for extra in ({"tools": [{"type": "function", "function": {}}]},
                  {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                  {"tool_choice": "required"},
                  {"parallel_tool_calls": "yes"},
                  {"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}):
        body = {"messages": ASK, **extra}
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=ids[0], max_tokens=2, **body)

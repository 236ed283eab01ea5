"""Tools, reasoning and structured output on the Anthropic Messages API (anthropic SDK) and the OpenAI Responses
API (openai SDK's client.responses), through a test-started server on the tiny scripted models of
test_tool_templates.py (a Qwen-style tool template, a Qwen3-style thinking template; see scripted_gguf.py)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from scripted_gguf import ANSWER, THOUGHT
from server_helpers import serve_scripted, server_fixture

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
A_TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": SCHEMA}]
R_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": SCHEMA}]
ASK = "Weather in Paris?"
PARIS = {"city": "Paris"}


server = server_fixture(serve_scripted, "scripted")


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


GREEDY = {"extra_body": {"temperature": 0, "top_k": 1}}


# --- Anthropic Messages ------------------------------------------------------------------------------------------

def test_anthropic_tool_use_round_trip(claude, server):
    msg = claude.messages.create(model="tooly", max_tokens=20, tools=A_TOOLS,
                                 messages=[{"role": "user", "content": ASK}], **GREEDY)
    assert msg.stop_reason == "tool_use"
    (block,) = msg.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert (block.name, block.input) == ("get_weather", PARIS)
    # the next turn sends the tool_use back with its tool_result: both reach the template
    history = [{"role": "user", "content": ASK}, {"role": "assistant", "content": msg.to_dict()["content"]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                             "content": [{"type": "text", "text": "18 C, sunny"}]}]}]
    again = claude.messages.create(model="tooly", max_tokens=20, tools=A_TOOLS, messages=history, **GREEDY)
    assert again.stop_reason == "tool_use"
    n = claude.messages.count_tokens(model="tooly", tools=A_TOOLS, messages=history).input_tokens
    assert again.usage.input_tokens + (again.usage.cache_read_input_tokens or 0) == n
    from edgeserve.server.api.anthropic import parse_messages_request
    from edgeserve.server.chat_setup import chat_setup

    lm = server.manager.entries["tooly"].lm
    req = parse_messages_request({"model": "tooly", "max_tokens": 1, "tools": A_TOOLS, "messages": history})
    prompt = chat_setup(req, lm.chat_template).prompt
    assert '<tool_response>\n18 C, sunny\n</tool_response>' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '"description": "Weather in a city"' in prompt


def test_anthropic_tool_use_streamed(claude):
    kw = dict(model="tooly", max_tokens=20, tools=A_TOOLS, messages=[{"role": "user", "content": ASK}], **GREEDY)
    events = list(claude.messages.create(stream=True, **kw))
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]
    assert starts[0].content_block.name == "get_weather" and starts[0].content_block.input == {}
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == PARIS
    assert events[-2].type == "message_delta" and events[-2].delta.stop_reason == "tool_use"
    with claude.messages.stream(**kw) as s:  # the SDK's helper assembles the same tool_use block
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", PARIS)]


def test_anthropic_tool_choice(claude):
    none = claude.messages.create(model="tooly", max_tokens=20, tools=A_TOOLS, tool_choice={"type": "none"},
                                  messages=[{"role": "user", "content": ASK}], **GREEDY)
    assert none.stop_reason == "end_turn" and [b.type for b in none.content] == ["text"]
    assert "get_weather" in none.content[0].text
    # forced: the reply is constrained to the tool's input schema
    forced = claude.messages.create(model="tooly", max_tokens=30, tools=A_TOOLS,
                                    tool_choice={"type": "tool", "name": "get_weather"},
                                    messages=[{"role": "user", "content": ASK}], **GREEDY)
    blocks = [b for b in forced.content if b.type == "tool_use"]
    if forced.stop_reason == "tool_use":
        assert len(blocks) == 1 and blocks[0].name == "get_weather" and isinstance(blocks[0].input["city"], str)
    else:  # a random-weights model may run out of tokens inside the string: the cut call still comes back
        assert forced.stop_reason == "max_tokens" and [b.name for b in blocks] == ["get_weather"]


def test_anthropic_thinking(claude):
    kw = dict(model="thinky", max_tokens=20, messages=[{"role": "user", "content": ASK}], **GREEDY)
    msg = claude.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == [
        ("thinking", THOUGHT), ("text", ANSWER)]
    off = claude.messages.create(thinking={"type": "disabled"}, **kw)
    assert [(b.type, b.text) for b in off.content] == [("text", ANSWER)]
    events = list(claude.messages.create(stream=True, **kw))
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    thought = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                      and e.delta.type == "thinking_delta")
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert (starts, thought, text) == (["thinking", "text"], THOUGHT, ANSWER)
    with claude.messages.stream(**kw) as st:  # the SDK's helper assembles the same blocks
        final = st.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == THOUGHT


def test_anthropic_structured_output(claude):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    msg = claude.messages.create(model="thinky", max_tokens=30, messages=[{"role": "user", "content": ASK}],
                                 output_config={"format": {"type": "json_schema", "schema": schema}}, **GREEDY)
    thinking, text = msg.content
    assert thinking.thinking == THOUGHT  # the grammar applies after the reasoning
    assert set(json.loads(text.text)) == {"ok"}


def test_anthropic_bad_tool_schema_is_400_in_its_shape(server):
    base = {"model": "tooly", "max_tokens": 4, "messages": [{"role": "user", "content": ASK}]}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        shape = c.post("/v1/messages", json={**base, "tools": [{"name": "f", "input_schema": ["x"]}]})
        # a schema the grammar engine cannot compile, under a forced choice
        grammar = c.post("/v1/messages", json={**base, "tool_choice": {"type": "any"}, "tools": [
            {"name": "f", "input_schema": {"type": "object", "not": {"required": ["a"]}}}]})
        fmt = c.post("/v1/messages", json={**base, "output_config": {"format": {
            "type": "json_schema", "schema": {"type": "object", "not": {"required": ["a"]}}}}})
        ok = c.post("/v1/messages", json={**base, "tools": A_TOOLS})
    for r, field in ((shape, "tools[0].input_schema"), (grammar, "tools"), (fmt, "output_config.format")):
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith(field) or field in body["error"]["message"], body
    assert ok.status_code == 200


# --- OpenAI Responses --------------------------------------------------------------------------------------------

def test_responses_function_call_round_trip(oai, server):
    r = oai.responses.create(model="tooly", input=ASK, tools=R_TOOLS, temperature=0, max_output_tokens=20)
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.status == "completed"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", PARIS)
    items = [{"role": "user", "content": ASK}, call.to_dict(),
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    again = oai.responses.create(model="tooly", input=items, tools=R_TOOLS, temperature=0, max_output_tokens=20)
    assert [o.type for o in again.output] == ["function_call"]
    from edgeserve.server.chat_setup import chat_setup
    from edgeserve.server.api.responses import parse_responses_request

    lm = server.manager.entries["tooly"].lm
    prompt = chat_setup(parse_responses_request({"model": "tooly", "input": items, "tools": R_TOOLS}),
                        lm.chat_template).prompt
    assert '<tool_response>\n18 C, sunny\n</tool_response>' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt


def test_responses_function_call_streamed(oai):
    kw = dict(model="tooly", input=ASK, tools=R_TOOLS, temperature=0, max_output_tokens=20)
    events = list(oai.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, done = events[2].item, events[5].item
    assert added.type == "function_call" and added.arguments == "" and added.id == done.id
    assert json.loads(events[3].delta) == json.loads(events[4].arguments) == PARIS
    assert done.call_id == events[-1].response.output[0].call_id
    with oai.responses.stream(**kw) as s:  # the SDK's helper assembles the same call
        final = s.get_final_response()
    assert [(o.type, o.name, json.loads(o.arguments)) for o in final.output] == [("function_call", "get_weather",
                                                                                  PARIS)]


def test_responses_tool_choice(oai):
    none = oai.responses.create(model="tooly", input=ASK, tools=R_TOOLS, tool_choice="none", temperature=0,
                                max_output_tokens=20)
    assert [o.type for o in none.output] == ["message"] and "get_weather" in none.output_text
    forced = oai.responses.create(model="tooly", input=ASK, tools=R_TOOLS, temperature=0, max_output_tokens=30,
                                  tool_choice={"type": "function", "name": "get_weather"})
    calls = [o for o in forced.output if o.type == "function_call"]
    if forced.status == "completed":
        assert len(calls) == 1 and isinstance(json.loads(calls[0].arguments)["city"], str)
    else:  # cut inside the arguments: the call with the arguments generated so far
        assert forced.incomplete_details.reason == "max_output_tokens" and [c.name for c in calls] == ["get_weather"]
        assert calls[0].arguments.startswith("{")


def test_responses_reasoning_items(oai):
    r = oai.responses.create(model="thinky", input=ASK, temperature=0, max_output_tokens=20)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT
    assert r.output_text == ANSWER and 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    off = oai.responses.create(model="thinky", input=ASK, temperature=0, max_output_tokens=20,
                               reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and off.output_text == ANSWER
    events = list(oai.responses.create(model="thinky", input=ASK, temperature=0, max_output_tokens=20, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, text) == (THOUGHT, ANSWER)
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]
    # a reasoning item sent back reaches the template as the assistant's reasoning_content
    from edgeserve.server.api.responses import parse_responses_request

    req = parse_responses_request({"model": "thinky", "input": [
        {"role": "user", "content": ASK}, reasoning.to_dict(), message.to_dict(), {"role": "user", "content": "ok"}]})
    assert req.messages[1] == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}


def test_responses_text_format(oai):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = oai.responses.create(model="thinky", input=ASK, temperature=0, max_output_tokens=30,
                             text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    assert r.output[0].type == "reasoning" and set(json.loads(r.output_text)) == {"ok"}
    obj = oai.responses.create(model="tooly", input=ASK, temperature=0, max_output_tokens=30,
                               text={"format": {"type": "json_object"}})
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_responses_bad_tool_schema_is_400_in_its_shape(oai):
    for kw, param in (({"tools": [{"type": "function", "name": "f", "parameters": ["x"]}]}, "tools[0].parameters"),
                      ({"tool_choice": "required", "tools": [{"type": "function", "name": "f", "parameters": {
                          "type": "object", "not": {"required": ["a"]}}}]}, "tools"),
                      ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
                          "type": "object", "not": {"required": ["a"]}}}}}, "text.format")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model="tooly", input=ASK, max_output_tokens=4, **kw)
        assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert oai.responses.create(model="tooly", input=ASK, max_output_tokens=4, tools=R_TOOLS).status


def test_show_capabilities_follow_the_template(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        tooly = c.post("/api/show", json={"model": "tooly"}).json()["capabilities"]
        thinky = c.post("/api/show", json={"model": "thinky"}).json()["capabilities"]
    assert tooly == ["completion", "tools"]  # the template renders `tools`
    assert thinky == ["completion", "thinking"]  # it writes <think>

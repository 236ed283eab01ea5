"""Anthropic Messages API (/v1/messages) through the anthropic SDK: shapes, Anthropic's stream event order,
usage against the tokenizer, stop sequences, errors in Anthropic's shape, x-api-key and Bearer auth."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from server_helpers import serve_tiny, server_fixture

KEY = "k-anthropic"
MSGS = [{"role": "user", "content": "hello there"}]
GREEDY = {"extra_body": {"temperature": 0, "top_k": 1, "top_p": 1.0}}  # this SDK has no sampling arguments


server = server_fixture(serve_tiny, "anthropic", api_key=KEY)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY)  # sends x-api-key


def test_create_shape_and_usage(client):
    msg = client.messages.create(model="tiny", max_tokens=8, system="be brief", messages=MSGS, **GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens == 8 or msg.stop_reason == "end_turn"
    counted = client.messages.count_tokens(model="tiny", system="be brief", messages=MSGS).input_tokens
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == counted
    without_system = client.messages.count_tokens(model="tiny", messages=MSGS).input_tokens
    assert without_system < counted  # the system prompt is in the rendered prompt


def test_stream_event_order_matches_create(client):
    kw = dict(model="tiny", max_tokens=10, messages=MSGS, **GREEDY)
    whole = client.messages.create(**kw)
    events = list(client.messages.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[1] == "content_block_start"
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) <= {"content_block_delta", "ping"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    delta = events[-2]
    assert delta.delta.stop_reason == whole.stop_reason and delta.usage.output_tokens == whole.usage.output_tokens
    assert events[0].message.usage.input_tokens > 0
    with client.messages.stream(**kw) as s:  # the SDK's helper assembles the same message
        final = s.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason


def test_stop_sequences(client):
    kw = dict(model="tiny", max_tokens=16, messages=MSGS, **GREEDY)
    text = client.messages.create(**kw).content[0].text
    stop = text[3:5]
    if not stop.strip():
        pytest.skip("greedy text has no usable stop string")
    msg = client.messages.create(stop_sequences=[stop], **kw)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("body, field", [
    ({"tools": [{"name": "f", "input_schema": "object"}]}, "tools[0].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
    ({"temperature": 1.5}, "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].source"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]}, "messages[1].content"),  # prefill with calls
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_requests_are_400_in_anthropic_shape(server, body, field):
    full = {"model": "tiny", "max_tokens": 4, "messages": MSGS, **body}
    r = httpx.post(server.url + "/v1/messages", json=full, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert field in err["error"]["message"]


def test_sdk_errors_then_success(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=MSGS,
                               tools=[{"name": "f", "input_schema": {"type": "object"}}, {"name": "f", "input_schema": {}}])
    assert "tools[1]" in str(e.value) and "defined twice" in str(e.value)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4, messages=MSGS)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong").messages.create(model="tiny", max_tokens=4,
                                                                                  messages=MSGS)
    assert e.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=server.url, api_key=None, auth_token=KEY)  # Authorization: Bearer
    assert bearer.messages.create(model="tiny", max_tokens=2, messages=MSGS).usage.output_tokens <= 2
    assert client.messages.create(model="tiny", max_tokens=2, messages=MSGS).type == "message"

"""OpenAI Responses API (/v1/responses, stateless) through the openai SDK's client.responses: shapes, the
response.* stream event order, usage against the tokenizer, errors naming the field, auth."""

from __future__ import annotations

import httpx
import openai
import pytest

from server_helpers import serve_tiny, server_fixture

KEY = "k-responses"


server = server_fixture(serve_tiny, "responses", api_key=KEY)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)


def _prompt_tokens(server, messages) -> int:
    """The prompt's token count through the same template (as the Anthropic count route renders it)."""
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages,
                                                               "max_tokens": 1}, headers={"x-api-key": KEY})
    return r.json()["usage"]["prompt_tokens"]


def test_create_string_input(server, client):
    r = client.responses.create(model="tiny", input="hello there", instructions="be brief", max_output_tokens=8,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.status in ("completed", "incomplete")
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output[0].content[0].type == "output_text"
    assert r.output_text == r.output[0].content[0].text
    assert r.usage.output_tokens == 8 or r.status == "completed"
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    expected = _prompt_tokens(server, [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "hello there"}])
    assert r.usage.input_tokens == expected
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_items_input_equals_chat(server, client):
    items = [{"role": "developer", "content": "be brief"},
             {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
             {"role": "user", "content": "how are you"}]
    r = client.responses.create(model="tiny", input=items, max_output_tokens=6, temperature=0)
    chat = httpx.post(server.url + "/v1/chat/completions", headers={"x-api-key": KEY}, json={
        "model": "tiny", "max_tokens": 6, "temperature": 0, "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "how are you"}]}).json()
    assert r.output_text == chat["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_stream_event_order(client):
    kw = dict(model="tiny", input="hello there", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert set(types[4:-4]) <= {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(**kw) as s:  # the SDK's helper assembles the same response
        last = list(s)[-1]  # (its get_final_response() needs response.completed; a cut reply is .incomplete)
    assert last.type == f"response.{whole.status}" and last.response.output_text == text


@pytest.mark.parametrize("kw, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "object"}]}, "tools[0].parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"include": [{"x": 1}]}, "include"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}]}, "input[0].content[0]"),
    ({"input": ""}, "input"),
    ({"temperature": "hot"}, "temperature"),
])
def test_bad_requests_name_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": "tiny", "input": "hi", **kw})
    assert e.value.status_code == 400 and e.value.body["param"] == param
    if param == "previous_response_id":
        assert "stores no conversations" in e.value.body["message"]


def test_unknown_model_auth_then_success(server, client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong").responses.create(model="tiny", input="hi")
    assert client.responses.create(model="tiny", input="hi", max_output_tokens=2).usage.output_tokens <= 2

"""Resumable OpenAI streams (issue 52 item 14): with `stream_options.resumable` a chat or completion stream runs on
after its client drops, and the client reattaches through the openai client by repeating its POST with a
`Last-Event-ID: ID/N` header (ID: the chunks' id; N: the last chunk it read, counting from 0), or with
GET /v1/chat/completions/{id}?starting_after=N; a stream nobody follows is cancelled after the grace period."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_helpers import gated_steps, serve_tiny, server_fixture, wait_until

GRACE = 5.0
MESSAGES = [{"role": "user", "content": "hello there"}]


server = server_fixture(serve_tiny, "resumable", resume_grace_seconds=GRACE)


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)  # loads the model
    return c


@pytest.fixture
def gate(server, client):
    with gated_steps(server) as g:
        yield g


def _text(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _sse_data(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_a_dropped_chat_stream_runs_on_and_the_openai_client_resumes_it(server, client, gate):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    gate.allow(6)  # a few tokens (the first chunk comes with the first one that decodes to text), then steps wait
    stream = client.chat.completions.create(stream=True, stream_options={"resumable": True}, **kw)
    first = [next(iter(stream))]
    stream.close()  # the client drops with the reply under way
    sid = first[0].id
    gate.open()
    rest = list(client.chat.completions.create(stream=True, extra_headers={"Last-Event-ID": f"{sid}/0"}, **kw))
    whole = client.chat.completions.create(**kw)
    assert _text(first + rest) == whole.choices[0].message.content
    assert rest[-1].choices[0].finish_reason == whole.choices[0].finish_reason and {c.id for c in rest} == {sid}
    # GET by id, from any event on: the same chunks again, then [DONE]
    raw = httpx.get(f"{server.url}/v1/chat/completions/{sid}", params={"starting_after": 0})
    data = _sse_data(raw.text)
    assert data[-1] == "[DONE]" and [json.loads(d) for d in data[:-1]] == [c.model_dump(exclude_unset=True)
                                                                           for c in rest]


def test_a_resumable_completion_stream_reattaches_by_get(server, client):
    r = client.completions.create(model="tiny", prompt="once upon", max_tokens=6, temperature=0, stream=True,
                                  stream_options={"resumable": True})
    chunks = list(r)
    raw = httpx.get(f"{server.url}/v1/completions/{chunks[0].id}")
    data = _sse_data(raw.text)
    assert data[-1] == "[DONE]" and "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == \
        "".join(c.choices[0].text for c in chunks)


def test_a_stream_nobody_follows_is_cancelled_after_the_grace(server, client, gate):
    core = server.manager.entries["tiny"].engine.core
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 200, "stream": True,
            "stream_options": {"resumable": True}}) as r:
        assert r.status_code == 200
    assert gate.waiting.wait(30)  # submitted; its steps wait on the gate
    store = server.app.state.server.responses
    entry = next(e for e in store._items.values() if e.id.startswith("chatcmpl-") and not e.done)
    assert wait_until(lambda: entry.done, timeout=GRACE + 30)
    assert entry.snapshot["status"] == "cancelled"
    gate.open()
    assert wait_until(lambda: core.num_unfinished == 0, timeout=30)  # aborted, not run to 200 tokens


def test_bad_resumable_requests(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True,
                                       stream_options={"resumable": "yes"})
    assert e.value.body["param"] == "stream_options.resumable"
    with pytest.raises(openai.NotFoundError) as e:
        list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True,
                                            extra_headers={"Last-Event-ID": "chatcmpl-gone/3"}))
    assert e.value.body["param"] == "response_id"
    r = httpx.get(f"{server.url}/v1/chat/completions/chatcmpl-nope")
    assert r.status_code == 404 and "chatcmpl-nope" in r.json()["error"]["message"]

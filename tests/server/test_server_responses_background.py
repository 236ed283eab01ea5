"""Responses background mode through the openai SDK: `background: true` answers at once (queued), GET polls,
the stream survives a disconnect and resumes from an event number (starting_after / Last-Event-ID), cancel stops
the engine request, unknown ids are 404s, and the store is bounded."""

from __future__ import annotations

import httpx
import openai
import pytest

from server_helpers import gated_steps, serve_tiny, wait_until

KEY = "k-background"
CAPACITY = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_tiny(tmp_path_factory.mktemp("background"), api_key=KEY, max_stored_responses=CAPACITY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    c.responses.create(model="tiny", input="warm up", max_output_tokens=1)  # loads the model
    return c


@pytest.fixture
def gate(server, client):
    with gated_steps(server) as g:
        yield g


KW = dict(model="tiny", input="hello there", temperature=0)


def _final(client, rid):
    assert wait_until(lambda: client.responses.retrieve(rid).status not in ("queued", "in_progress"), timeout=60)
    return client.responses.retrieve(rid)


def test_background_returns_at_once_polls_and_completes(server, client, gate):
    r = client.responses.create(background=True, max_output_tokens=6, **KW)  # no step has run: it cannot be done
    assert r.status == "queued" and r.background is True and r.output == [] and r.id.startswith("resp_")
    assert wait_until(lambda: client.responses.retrieve(r.id).status == "in_progress", timeout=30)
    gate.open()
    done = _final(client, r.id)
    whole = client.responses.create(max_output_tokens=6, **KW)
    assert done.status == whole.status and done.output_text == whole.output_text
    assert done.usage.output_tokens == whole.usage.output_tokens and done.background is True


def test_stream_survives_a_disconnect_and_resumes(server, client, gate):
    first = []
    with client.responses.create(background=True, stream=True, max_output_tokens=16, **KW) as events:
        for e in events:
            first.append(e)
            if e.type == "response.in_progress":
                break  # the client goes away with the reply under way (its steps wait on the gate)
    rid, last_seq = first[0].response.id, first[-1].sequence_number
    assert client.responses.retrieve(rid).status == "in_progress"
    gate.open()
    done = _final(client, rid)
    assert done.status in ("completed", "incomplete")  # it ran on without its client
    assert done.status == "completed" or done.usage.output_tokens == 16
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=last_seq))
    assert [e.sequence_number for e in rest] == list(range(last_seq + 1, last_seq + 1 + len(rest)))
    assert rest[-1].type == f"response.{done.status}"
    text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    assert text == done.output_text and rest[-1].response.output_text == text
    with client.responses.stream(response_id=rid, starting_after=last_seq) as s:  # the SDK's helper replays all
        helper = list(s)
    assert [e.sequence_number for e in helper] == [e.sequence_number for e in rest]
    # an EventSource reconnect: Last-Event-ID names the last event seen (its SSE id: ID/N)
    for last in (f"{rid}/{last_seq}", str(last_seq)):
        raw = httpx.get(f"{server.url}/v1/responses/{rid}", params={"stream": "true"},
                        headers={"authorization": f"Bearer {KEY}", "last-event-id": last})
        ids = [line[4:] for line in raw.text.splitlines() if line.startswith("id: ")]
        assert ids == [f"{rid}/{e.sequence_number}" for e in rest]


def test_cancel_stops_the_engine_request(server, client, gate):
    core = server.manager.entries["tiny"].engine.core
    r = client.responses.create(background=True, max_output_tokens=200, **KW)
    assert gate.waiting.wait(30)
    assert wait_until(lambda: client.responses.retrieve(r.id).status == "in_progress", timeout=30)
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(r.id).status == "cancelled"
    gate.open()
    assert wait_until(lambda: core.num_unfinished == 0, timeout=30)  # aborted, not run to 200 tokens
    assert client.responses.cancel(r.id).status == "cancelled"  # cancelling again returns it as it is
    events = list(client.responses.retrieve(r.id, stream=True))
    assert events[0].type == "response.created" and events[-1].type != "response.completed"


def test_unknown_ids_bad_queries_and_delete(server, client):
    for call in (lambda: client.responses.retrieve("resp_nope"), lambda: client.responses.cancel("resp_nope"),
                 lambda: client.responses.delete("resp_nope")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["param"] == "response_id" and "resp_nope" in e.value.body["message"]
    r = client.responses.create(background=True, max_output_tokens=2, **KW)
    _final(client, r.id)
    h = {"authorization": f"Bearer {KEY}"}
    for params, param in (({"stream": "true", "starting_after": "x"}, "starting_after"),
                          ({"stream": "maybe"}, "stream"), ({"starting_after": "1"}, "starting_after")):
        bad = httpx.get(f"{server.url}/v1/responses/{r.id}", params=params, headers=h)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(background=True, store=False, **KW)
    assert e.value.body["param"] == "store"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_a_request_that_fails_after_it_was_queued_is_failed(client):
    r = client.responses.create(background=True, model="tiny", input="hello " * 5000)  # past the context
    assert r.status == "queued"
    done = _final(client, r.id)
    assert done.status == "failed" and done.error.code == "invalid_prompt" and "context" in done.error.message
    events = list(client.responses.retrieve(r.id, stream=True))
    assert [e.type for e in events] == ["response.created", "error", "response.failed"]
    assert events[0].response.status == "queued" and [e.sequence_number for e in events] == [0, 1, 2]


def test_the_store_is_bounded(server, client, gate):
    running = [client.responses.create(background=True, max_output_tokens=50, **KW) for _ in range(CAPACITY)]
    with pytest.raises(openai.RateLimitError) as e:  # every slot holds a running response
        client.responses.create(background=True, **KW)
    assert e.value.body["code"] == "too_many_background_responses"
    for r in running:
        client.responses.cancel(r.id)
    newest = client.responses.create(background=True, max_output_tokens=2, **KW)  # the oldest finished one goes
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(running[0].id)
    assert client.responses.retrieve(running[1].id).status == "cancelled"
    gate.open()
    assert _final(client, newest.id).status in ("completed", "incomplete")

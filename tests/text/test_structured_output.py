"""Structured output and forced tool calls on the real default model, through a test-started server: the openai
SDK, Ollama's routes, and every sampled reply validated against its schema with `jsonschema`."""

from __future__ import annotations

import json

import anyio
import httpx
import jsonschema
import openai
import pytest

from edgeserve.registry import DEFAULT_MODEL
from edgeserve.server import ServerConfig
from edgeserve.engine.config import EngineConfig
from server_helpers import concurrent_replies, serve

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 2},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                              "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
             "required": ["a", "b"], "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use a tool."}]


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def server(default_model_path):
    with serve(ServerConfig(engine=EngineConfig(max_num_seqs=16, kv_cache_gb=0.3),
                            models=(DEFAULT_MODEL,), keep_alive=None)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def test_fifty_sampled_replies_match_the_schema(server):
    def person(client, i: int):
        return client.chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": f"Invent person number {i} as JSON."}],
            temperature=1.0, seed=i, max_tokens=120, response_format=_format(PERSON))

    replies = concurrent_replies(server, 50, person, timeout=1800)
    for r in replies:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert len({r.choices[0].message.content for r in replies}) > 1  # sampled, not one fixed answer


def test_json_object_mode_and_completions(client):
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                       temperature=0.8, seed=1, max_tokens=60,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    c = client.completions.create(model=DEFAULT_MODEL, prompt="A person:", max_tokens=150, temperature=0,
                                  extra_body={"response_format": _format(PERSON)})
    assert c.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(c.choices[0].text), PERSON)


def test_max_tokens_cut_is_length(client):
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "A person."}],
                                       temperature=0, max_tokens=3, response_format=_format(PERSON))
    assert r.choices[0].finish_reason == "length"


def test_ollama_format(server):
    with httpx.Client(base_url=server.url, timeout=600) as c:
        chat = c.post("/api/chat", json={"model": DEFAULT_MODEL, "stream": False, "format": PERSON,
                                         "messages": [{"role": "user", "content": "A person as JSON."}],
                                         "options": {"temperature": 0.9, "seed": 3, "num_predict": 150}}).json()
        gen = c.post("/api/generate", json={"model": DEFAULT_MODEL, "stream": False, "format": "json",
                                            "prompt": "Give me JSON.", "options": {"temperature": 0,
                                                                                   "num_predict": 80}}).json()
        streamed = [json.loads(x) for x in c.post("/api/generate", json={
            "model": DEFAULT_MODEL, "format": PERSON, "prompt": "A person.",
            "options": {"temperature": 0, "num_predict": 150}}).text.splitlines()]
        bad = c.post("/api/chat", json={"model": DEFAULT_MODEL, "stream": False, "format": {"not": {}},
                                        "messages": [{"role": "user", "content": "x"}]})
    jsonschema.validate(json.loads(chat["message"]["content"]), PERSON)
    if gen["done_reason"] == "stop":
        assert isinstance(json.loads(gen["response"]), dict)
    jsonschema.validate(json.loads("".join(x["response"] for x in streamed)), PERSON)
    assert bad.status_code == 400 and "not" in bad.json()["error"]


def test_unsupported_schema_feature_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, max_tokens=5,
                                       response_format=_format({"type": "object", "not": {"required": ["a"]}}))
    assert "not" in e.value.body["message"] and e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, max_tokens=5,
                                       response_format={"type": "xml"})


def _check_calls(calls, parallel: bool = True) -> None:
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_validate(client, choice):
    for seed in range(3):
        # one call: at temperature 1 an unbounded run of parallel calls can legitimately reach any token limit
        r = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=400)
        assert r.choices[0].finish_reason == "tool_calls"
        _check_calls(r.choices[0].message.tool_calls)
        if isinstance(choice, dict):
            assert {c.function.name for c in r.choices[0].message.tool_calls} == {"add"}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_streamed(client, choice):
    stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                            temperature=0.7, seed=5, max_tokens=120, stream=True,
                                            parallel_tool_calls=False)
    calls: dict = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_multi_turn_with_a_tool_result(client):
    first = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    second = client.chat.completions.create(model=DEFAULT_MODEL, messages=history, tools=TOOLS, temperature=0,
                                            max_tokens=30)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.choices[0].message.content or second.choices[0].message.tool_calls


def test_mixed_batch_equals_each_alone(server, monkeypatch):
    """Greedy: a constrained, a tool-calling and a plain request together give what each gives alone.

    Batch invariance is the CPU's default (the native kernels sum a row the same way at every batch size); on a
    GPU it needs EDGESERVE_BATCH_INVARIANT=1, without which the quantized matmuls take a GEMV for a few rows and a
    tiled kernel for more, and a request's greedy text changes with what is batched beside it (seen on an H100).
    """
    monkeypatch.setenv("EDGESERVE_BATCH_INVARIANT", "1")
    bodies = [
        dict(messages=[{"role": "user", "content": "A person as JSON."}], response_format=_format(PERSON)),
        dict(messages=ASK, tools=TOOLS, tool_choice="required"),
        dict(messages=[{"role": "user", "content": "Tell me a story."}]),
        dict(messages=[{"role": "user", "content": "Any JSON."}], response_format={"type": "json_object"}),
    ]

    async def run(indices: list[int]) -> dict[int, tuple]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=900)
        out: dict[int, tuple] = {}

        async def one(i: int) -> None:
            r = await client.chat.completions.create(model=DEFAULT_MODEL, temperature=0, max_tokens=60, **bodies[i])
            m = r.choices[0].message
            out[i] = (m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or []])

        async with anyio.create_task_group() as tg:
            for i in indices:
                tg.start_soon(one, i)
        await client.close()
        return out

    together = anyio.run(run, list(range(len(bodies))))
    alone = {i: anyio.run(run, [i])[i] for i in range(len(bodies))}
    assert together == alone

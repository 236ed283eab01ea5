"""The client libraries users run, driving a test-started server as their users do (issue 34, section 2): the
ollama python client, the openai SDK (chat, Responses with pydantic parsing as the Agents SDK and instructor use it,
embeddings), the anthropic SDK, and pydantic-ai's default structured output; the OpenAI Agents SDK when installed.
Each: plain and streamed chat, a forced tool round trip, structured output into a schema, and embeddings where the
client has them. On the tiny scripted models of test_tool_templates.py (a
Qwen-style tool template, a Qwen3-style thinking template) and the catalog's all-minilm."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import ollama
import openai
import pytest
from pydantic import BaseModel

from scripted_gguf import ANSWER, THOUGHT
from server_helpers import serve_scripted

ASK = [{"role": "user", "content": "Weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}  # bounded: a forced call always completes
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": CITY}}]


class Verdict(BaseModel):
    """A reply with a bounded schema (a boolean, nothing else), so a random-weights model completes it."""

    model_config = {"extra": "forbid"}
    ok: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from edgeserve.registry import pull

    pull("all-minilm", progress=False)  # fetched once into the user cache (test_server_embeddings does the same)
    with serve_scripted(tmp_path_factory.mktemp("libraries"), "all-minilm") as s:
        yield s


# --- ollama python client ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ol(server):
    return ollama.Client(host=server.url)


OPTS = {"temperature": 0, "top_k": 1, "num_predict": 30}


def get_weather(city: str) -> str:
    """Weather in a city.

    Args:
        city: The city's name
    """
    return "18 C, sunny"


def test_ollama_client_models(ol):
    assert {"tooly", "thinky", "all-minilm"} <= {m.model for m in ol.list().models}
    assert "thinking" in ol.show("thinky").capabilities
    ol.generate(model="tooly", prompt="")  # an empty prompt loads the model
    (entry,) = [m for m in ol.ps().models if m.model == "tooly"]
    assert entry.context_length and entry.context_length > 0


def test_ollama_client_chat_plain_and_streamed(ol):
    r = ol.chat(model="thinky", messages=ASK, options=OPTS)
    assert (r.message.content, r.message.thinking, r.done_reason) == (ANSWER, THOUGHT, "stop")
    parts = list(ol.chat(model="thinky", messages=ASK, options=OPTS, stream=True))
    assert "".join(p.message.content for p in parts) == ANSWER
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
    assert parts[-1].done and parts[-1].eval_count == r.eval_count
    g = ol.generate(model="thinky", prompt="Weather in Paris?", think=False, options=OPTS)
    assert g.response and g.done


def test_ollama_client_tool_round_trip(ol):
    r = ol.chat(model="tooly", messages=ASK, tools=[get_weather], options=OPTS)  # a function, as its docs show
    (call,) = r.message.tool_calls
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    history = [*ASK, r.message, {"role": "tool", "content": get_weather(**call.function.arguments),
                                 "tool_name": "get_weather"}]
    again = ol.chat(model="tooly", messages=history, tools=[get_weather], options=OPTS)
    assert again.done


def test_ollama_client_structured_output_logprobs_and_think(ol):
    r = ol.chat(model="thinky", messages=ASK, format=Verdict.model_json_schema(), options=OPTS)
    assert r.message.thinking == THOUGHT  # the grammar applies after the reasoning
    Verdict.model_validate_json(r.message.content)
    lp = ol.generate(model="thinky", prompt="hi", think=False, logprobs=True, top_logprobs=2,
                     options={"num_predict": 4})
    assert len(lp.logprobs) == lp.eval_count and all(len(x.top_logprobs) == 2 for x in lp.logprobs)
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model="tooly", messages=ASK, think=True)
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error


def test_ollama_client_embed(ol):
    r = ol.embed(model="all-minilm", input=["The cat sits on the mat.", "A dog runs."])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 384
    assert len(ol.embeddings(model="all-minilm", prompt="The cat").embedding) == 384


# --- openai SDK ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_chat_plain_and_streamed(oai):
    r = oai.chat.completions.create(model="thinky", messages=ASK, temperature=0, max_tokens=30)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (ANSWER, "stop")
    stream = oai.chat.completions.create(model="thinky", messages=ASK, temperature=0, max_tokens=30, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_openai_forced_tool_round_trip(oai):
    kw = dict(model="tooly", tools=TOOLS, temperature=0, max_tokens=100)
    r = oai.chat.completions.create(messages=ASK, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                    **kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    history = [*ASK, r.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    assert oai.chat.completions.create(messages=history, **kw).choices[0].finish_reason in ("stop", "tool_calls")


def test_openai_structured_output_parse(oai):
    r = oai.chat.completions.parse(model="thinky", messages=ASK, temperature=0, max_tokens=30,
                                   response_format=Verdict)
    assert isinstance(r.choices[0].message.parsed, Verdict)
    assert r.choices[0].message.reasoning_content == THOUGHT  # type: ignore[attr-defined]


def test_openai_responses_forced_tool_with_output_type(oai):
    """What the Agents SDK sends when a tool is forced and the agent has an output type (and instructor's
    Responses-tools mode): tool_choice required beside text.format; the tool choice governs this turn."""
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}]
    r = oai.responses.parse(model="tooly", input="Weather in Paris?", tools=tools, tool_choice="required",
                            text_format=Verdict, temperature=0, max_output_tokens=100)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    follow = oai.responses.parse(model="thinky", text_format=Verdict, temperature=0, max_output_tokens=30, input=[
        {"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}])
    assert isinstance(follow.output_parsed, Verdict)  # the format governs the final text turn


def test_openai_embeddings(oai):
    r = oai.embeddings.create(model="all-minilm", input=["The cat sits on the mat.", "A dog runs."])
    assert [len(d.embedding) for d in r.data] == [384, 384] and r.usage.prompt_tokens > 0


# --- anthropic SDK ------------------------------------------------------------------------------------------------

GREEDY = {"temperature": 0, "top_k": 1}  # the anthropic SDK has no sampling arguments


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_anthropic_plain_and_streamed(claude):
    kw = dict(model="thinky", max_tokens=30, messages=ASK, extra_body=GREEDY)
    msg = claude.messages.create(**kw)
    assert [b.type for b in msg.content] == ["thinking", "text"] and msg.content[1].text == ANSWER
    with claude.messages.stream(**kw) as s:
        assert "".join(s.text_stream) == ANSWER
        assert s.get_final_message().content[1].text == ANSWER


def test_anthropic_forced_tool_round_trip_with_output_format(claude):
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": CITY}]
    fmt = {"format": {"type": "json_schema", "schema": Verdict.model_json_schema()}}
    msg = claude.messages.create(model="tooly", max_tokens=100, messages=ASK, tools=tools, extra_body=GREEDY,
                                 tool_choice={"type": "tool", "name": "get_weather"}, output_config=fmt)
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and use.input["city"] in ("Paris", "Rome")
    history = [*ASK, {"role": "assistant", "content": msg.to_dict()["content"]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
    final = claude.messages.create(model="tooly", max_tokens=40, messages=history, tools=tools, extra_body=GREEDY,
                                   output_config=fmt)
    Verdict.model_validate_json(final.content[-1].text)


# --- OpenAI Agents SDK (optional: not in the test extra, it brings mcp, websockets and more) -----------------------

def test_agents_sdk_forced_tool_then_output_type(server):
    """An agent with a forced tool and an output type: the SDK sends tool_choice required beside text.format, runs
    the tool, then asks again (tool choice reset) and parses the final text into the output type."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # traces would go to OpenAI's servers
    calls = []

    @agents.function_tool
    def weather(city: Literal["Paris", "Rome"]) -> str:  # bounded: a forced call always completes
        """Weather in a city."""
        calls.append(city)
        return "18 C, sunny"

    model = agents.OpenAIResponsesModel(model="tooly", openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0))
    agent = agents.Agent(name="w", instructions="Answer briefly.", model=model, tools=[weather], output_type=Verdict,
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                             max_tokens=100))
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=3)
    assert len(calls) == 1 and isinstance(result.final_output, Verdict)


# --- pydantic-ai (pydantic-ai-slim[openai]: a few small packages, in the test extra) ----------------------------------

def test_pydantic_ai_default_structured_output(server):
    """pydantic-ai's default structured output: a `final_result` tool under tool_choice "required", whose call
    validates into the output type. (The bound on calls under "required" is tested in test_server_client_faults:
    this scripted model closes the array after one call either way.)"""
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("tooly", provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused"))
    agent = pydantic_ai.Agent(model, output_type=Verdict, model_settings={"temperature": 0, "max_tokens": 300})
    result = agent.run_sync("Weather in Paris?")
    assert isinstance(result.output, Verdict)

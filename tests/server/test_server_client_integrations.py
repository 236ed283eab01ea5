"""More client libraries users run, unchanged against a test-started server (issue 34, section 2): LangChain's
ChatOpenAI and ChatOllama (invoke, stream, tool binding, structured output, embeddings), litellm through its
openai-compatible and ollama providers (completion, streaming, tools, embeddings), instructor (a pydantic model out
of a chat completion; optional, see below) and simonw's `llm` CLI (its extra OpenAI-compatible models and the
llm-ollama plugin). On the scripted models of test_tool_templates.py and the catalog's all-minilm, as
test_server_client_libraries.py does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pydantic import BaseModel

from scripted_gguf import ANSWER, THOUGHT
from server_helpers import serve_scripted

ASK = "Weather in Paris?"
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}  # bounded: a forced call always completes
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": CITY}}


class Verdict(BaseModel):
    """A reply with a bounded schema (a boolean, nothing else), so a random-weights model completes it."""

    model_config = {"extra": "forbid"}
    ok: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from edgeserve.registry import pull

    pull("all-minilm", progress=False)
    with serve_scripted(tmp_path_factory.mktemp("integrations"), "all-minilm") as s:
        yield s


# --- LangChain ----------------------------------------------------------------------------------------------------

def test_langchain_chat_openai(server):
    """ChatOpenAI: invoke and stream a reasoning model (the answer in content), a forced tool through bind_tools
    and its round trip with a ToolMessage, with_structured_output into a pydantic model, and OpenAIEmbeddings."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    kw = dict(base_url=server.url + "/v1", api_key="unused", temperature=0, max_retries=0)
    chat = ChatOpenAI(model="thinky", max_tokens=30, **kw)
    assert chat.invoke(ASK).content == ANSWER
    assert "".join(c.content for c in chat.stream(ASK)) == ANSWER
    assert isinstance(chat.with_structured_output(Verdict).invoke(ASK), Verdict)

    tools = ChatOpenAI(model="tooly", max_tokens=100, **kw).bind_tools([TOOL], tool_choice="get_weather")
    reply = tools.invoke([HumanMessage(ASK)])
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome")
    again = tools.invoke([HumanMessage(ASK), reply, ToolMessage("18 C, sunny", tool_call_id=call["id"])])
    assert again.response_metadata["finish_reason"] in ("stop", "tool_calls")

    # check_embedding_ctx_length=False sends text, as its docs say for non-OpenAI servers (True sends tiktoken ids)
    emb = OpenAIEmbeddings(model="all-minilm", base_url=server.url + "/v1", api_key="unused",
                           check_embedding_ctx_length=False)
    assert [len(v) for v in emb.embed_documents(["The cat sits.", "A dog runs."])] == [384, 384]
    assert len(emb.embed_query("The cat")) == 384


def test_langchain_chat_ollama(server):
    """ChatOllama: invoke and stream with reasoning kept apart, a tool through bind_tools and its round trip,
    with_structured_output (Ollama's `format` schema), and OllamaEmbeddings."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_ollama import ChatOllama, OllamaEmbeddings

    chat = ChatOllama(model="thinky", base_url=server.url, temperature=0, num_predict=30, reasoning=True)
    msg = chat.invoke(ASK)
    assert msg.content == ANSWER and msg.additional_kwargs["reasoning_content"] == THOUGHT
    assert "".join(c.content for c in chat.stream(ASK)) == ANSWER
    assert isinstance(chat.with_structured_output(Verdict).invoke(ASK), Verdict)

    tools = ChatOllama(model="tooly", base_url=server.url, temperature=0, num_predict=100).bind_tools([TOOL])
    reply = tools.invoke([HumanMessage(ASK)])
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
    again = tools.invoke([HumanMessage(ASK), reply, ToolMessage("18 C, sunny", tool_call_id=call["id"])])
    assert again.response_metadata["done"]

    emb = OllamaEmbeddings(model="all-minilm", base_url=server.url)
    assert [len(v) for v in emb.embed_documents(["The cat sits.", "A dog runs."])] == [384, 384]


# --- litellm ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list from GitHub
    import litellm

    return litellm


@pytest.mark.parametrize("provider", ["openai", "ollama_chat", "ollama"])
def test_litellm_completion_and_stream(server, litellm, provider):
    """completion() and its stream through the openai-compatible provider (/v1) and the two ollama ones
    (/api/chat, /api/generate), the reasoning kept apart from the answer."""
    base = server.url + ("/v1" if provider == "openai" else "")
    kw = dict(model=f"{provider}/thinky", api_base=base, api_key="unused", temperature=0, max_tokens=30,
              messages=[{"role": "user", "content": ASK}])
    r = litellm.completion(**kw)
    assert (r.choices[0].message.content, r.choices[0].message.reasoning_content) == (ANSWER, THOUGHT)
    assert "".join(c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **kw)) == ANSWER


@pytest.mark.parametrize("provider", ["openai", "ollama_chat"])
def test_litellm_tools_and_embeddings(server, litellm, provider):
    """A forced tool call and embeddings through the openai-compatible and the ollama providers."""
    base = server.url + ("/v1" if provider == "openai" else "")
    r = litellm.completion(model=f"{provider}/tooly", api_base=base, api_key="unused", temperature=0, max_tokens=100,
                           messages=[{"role": "user", "content": ASK}], tools=[TOOL],
                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    e = litellm.embedding(model=f"{'openai' if provider == 'openai' else 'ollama'}/all-minilm", api_base=base,
                          api_key="unused", input=["The cat sits.", "A dog runs."])
    assert [len(d["embedding"]) for d in e.data] == [384, 384]


# --- instructor (optional: 1.17 caps jiter below what the test extra's openai needs, so not in the extra) ------------

@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_response_model(server, mode):
    """instructor's default tools mode (a forced function call) and its json_schema mode, both into Verdict."""
    instructor = pytest.importorskip("instructor")
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0),
                                    mode=getattr(instructor.Mode, mode))
    out = client.chat.completions.create(model="tooly", response_model=Verdict, max_retries=0, temperature=0,
                                         max_tokens=100, messages=[{"role": "user", "content": ASK}])
    assert isinstance(out, Verdict)


# --- simonw's llm CLI ---------------------------------------------------------------------------------------------

def _llm(args: list[str], env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-m", "llm", *args], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def llm_env(server, tmp_path_factory):
    """LLM_USER_PATH with edgeserve as an extra OpenAI-compatible model, and OLLAMA_HOST for llm-ollama."""
    pytest.importorskip("llm")
    home = tmp_path_factory.mktemp("llm-home")
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: edge-thinky\n  model_name: thinky\n  api_base: {server.url}/v1\n")
    return {**os.environ, "LLM_USER_PATH": str(home), "OLLAMA_HOST": server.url, "OPENAI_API_KEY": "unused"}


def test_llm_cli_openai_compatible(llm_env):
    """A model in extra-openai-models.yaml (llm has no such file for embedding models: those come by the plugin)."""
    assert _llm(["-m", "edge-thinky", "-o", "temperature", "0", "-o", "max_tokens", "30", ASK],
                llm_env).strip() == ANSWER


def test_llm_cli_ollama_plugin(llm_env):
    """llm-ollama registers chat and embedding models by their /api/show capabilities: prompt and embed."""
    pytest.importorskip("llm_ollama")
    models = _llm(["models", "list"], llm_env)
    assert "ollama/thinky" in models and "ollama/tooly" in models and "ollama/all-minilm" not in models
    out = _llm(["-m", "ollama/thinky", "-o", "temperature", "0", "-o", "num_predict", "30", ASK], llm_env)
    assert out.strip() == ANSWER, out
    assert "ollama/all-minilm" in _llm(["embed-models", "list"], llm_env)
    assert len(json.loads(_llm(["embed", "-m", "ollama/all-minilm", "-c", "The cat sits."], llm_env))) == 384

"""Assistant prefill (continue_final_message): the prompt rendered as transformers' apply_chat_template(...,
continue_final_message=...) cuts it, on real templates of llama.cpp's models/templates/; the reply read from where
the prefill stops; and through a test-started server, the OpenAI route's continue_final_message /
add_generation_prompt, llama-server's and Ollama's continued final assistant message, and Anthropic's prefill,
each returning only the continuation, with bad input a 400 in the route's shape."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from chat_format_cases import chat_template, template_source
from edgeserve.engine.config import EngineConfig
from edgeserve.errors import ChatTemplateError
from edgeserve.loaders.chat_template import ChatTemplate
from edgeserve.server import ServerConfig
from edgeserve.server.chat_setup import chat_setup
from edgeserve.server.request import GenerationRequest
from edgeserve.text.continuation import render_continuation
from scripted_gguf import NEWLINE, TOOL_SCRIPT, TOOL_TEMPLATE, write_scripted_gguf
from server_helpers import serve, served_ids

USER = {"role": "user", "content": "Hey there!"}
PREFILL = {"role": "assistant", "content": "Hello, ", "reasoning_content": "I'm thinking"}
THOUGHT_ONLY = {"role": "assistant", "content": "", "reasoning_content": "I'm"}


def transformers_prompt(source: str, messages: list[dict], field: str, **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    (out,), _ = render_jinja_template([messages], chat_template=source, continue_final_message=field,
                                      add_generation_prompt=False, bos_token="", eos_token="", **kwargs)
    return out


@pytest.mark.parametrize("name", ["Qwen3.5-4B.jinja", "Qwen-QwQ-32B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
                                  "google-gemma-2-2b-it.jinja"])
def test_content_continuation_renders_as_transformers(name):
    messages = [USER, PREFILL]
    ours = render_continuation(chat_template(name), messages, "content", "<think>")
    assert ours == transformers_prompt(template_source(name), messages, "content")
    assert ours.endswith("Hello,") or ours.endswith("Hello, ")


@pytest.mark.parametrize("name", ["Qwen3.5-4B.jinja", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja"])
def test_reasoning_continuation_renders_as_transformers(name):
    messages = [USER, THOUGHT_ONLY]
    ours = render_continuation(chat_template(name), messages, "reasoning", "<think>")
    assert ours == transformers_prompt(template_source(name), messages, "reasoning_content")
    assert ours.endswith("<think>\nI'm")


def test_reasoning_a_template_drops_is_built_after_the_generation_prompt():
    """DeepSeek-R1 distills drop an assistant message's reasoning: the thought their generation prompt opens is
    continued instead (llama.cpp's construction)."""
    template = chat_template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")
    ours = render_continuation(template, [USER, THOUGHT_ONLY], "reasoning", "<think>")
    assert ours == template.render([USER], add_generation_prompt=True, enable_thinking=True) + "I'm"
    assert ours.endswith("<｜Assistant｜><think>\nI'm")
    # a generation prompt that closes the thought (reasoning off) still gets it continued
    assert render_continuation(template, [USER, THOUGHT_ONLY], "reasoning", "<think>", enable_thinking=False) == ours


def test_unrenderable_prefill_is_a_template_error():
    drops = ChatTemplate("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="does not show the final assistant message"):
        render_continuation(drops, [USER, PREFILL], "content", None)
    with pytest.raises(ChatTemplateError, match="does not reason"):
        render_continuation(chat_template("meta-llama-Llama-3.1-8B-Instruct.jinja"), [USER, THOUGHT_ONLY],
                            "reasoning", None)


def _setup(name: str, last: dict, kind: str, **fields):
    req = GenerationRequest(model="m", messages=[USER, last], continue_final_message=kind,
                            add_generation_prompt=False, **fields)
    return chat_setup(req, chat_template(name))


def _read(setup, text: str) -> tuple[str, str]:
    from edgeserve.engine.outputs import RequestOutput

    out = RequestOutput("r", text, [], None, "stop")
    setup.split(setup.parser(), out)
    return out.reasoning, out.text


def test_reply_is_read_from_where_the_prefill_stops():
    content = _setup("Qwen3.5-4B.jinja", PREFILL, "content")
    assert content.prefilled == ("I'm thinking", "Hello, ")
    assert _read(content, "world! <think>not a thought</think>") == ("", "world! <think>not a thought</think>")
    thought = _setup("Qwen3.5-4B.jinja", THOUGHT_ONLY, "auto")
    assert thought.continued == "reasoning" and thought.in_thought
    assert _read(thought, " thinking\n</think>\n\nHello") == (" thinking", "Hello")  # its leading space kept


def test_constraint_applies_to_the_continuation():
    from edgeserve.text.grammar import GrammarSpec

    schema = GrammarSpec.json_schema({"type": "object"})
    content = _setup("Qwen3.5-4B.jinja", PREFILL, "content", constraint=schema)
    assert content.constraint.think is None  # the thought is over: the grammar starts with the continuation
    thought = _setup("Qwen3.5-4B.jinja", THOUGHT_ONLY, "reasoning", constraint=schema)
    assert thought.constraint.think == ("", "</think>")  # after the continued thought closes


def test_harmony_continues_its_channel():
    name = "openai-gpt-oss-120b.jinja"
    content = _setup(name, PREFILL, "content")
    assert content.prompt.endswith("<|channel|>analysis<|message|>I'm thinking<|end|><|start|>assistant"
                                   "<|channel|>final<|message|>Hello, ")
    assert _read(content, "world!<|return|>") == ("", "world!")
    thought = _setup(name, THOUGHT_ONLY, "reasoning")
    assert thought.prompt.endswith("<|start|>assistant<|channel|>analysis<|message|>I'm")
    assert _read(thought, " thinking<|end|><|start|>assistant<|channel|>final<|message|>Hi<|return|>") == \
        (" thinking", "Hi")


# ------------------------------------------------------------------ through the server

# a template that shows an assistant's reasoning in <think> (as Qwen3's), and a model scripted to continue
PREFILL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m['reasoning_content'] %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n"
    "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FRESH, CONTINUED, MORE, ANSWER = "A new turn.", " world!", " and more", "Done."
SCRIPT = [(NEWLINE, FRESH), (FRESH, "<|im_end|>"), ("Hello,", CONTINUED), (CONTINUED, "<|im_end|>"),
          ("Pondering", MORE), (MORE, "</think>"), ("</think>", ANSWER), (ANSWER, "<|im_end|>")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefill")
    models = (str(write_scripted_gguf(d / "prefilly.gguf", SCRIPT, PREFILL_TEMPLATE, arch="qwen3")),
              str(write_scripted_gguf(d / "tooly.gguf", TOOL_SCRIPT, TOOL_TEMPLATE)))
    with serve(ServerConfig(engine=EngineConfig(max_num_seqs=2, kv_cache_gb=0.05), models=models,
                            keep_alive=None)) as s:
        yield s


@pytest.fixture(scope="module")
def names(server):
    return served_ids(server, "prefilly", "tooly")


GREEDY = {"temperature": 0, "max_tokens": 8}


def _chat(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={**GREEDY, **body}, timeout=60)


def test_openai_continue_final_message(server, names):
    msgs = [USER, {"role": "assistant", "content": "Hello,"}]
    r = _chat(server, {"model": names[0], "messages": msgs, "continue_final_message": True,
                       "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == CONTINUED  # the continuation only
    implicit = _chat(server, {"model": names[0], "messages": msgs})  # llama-server: a final assistant message
    assert implicit.json()["choices"][0]["message"]["content"] == CONTINUED
    new_turn = _chat(server, {"model": names[0], "messages": msgs, "add_generation_prompt": True})  # vLLM
    assert new_turn.json()["choices"][0]["message"]["content"] == FRESH


def test_openai_reasoning_continuation_streams(server, names):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    msgs = [USER, {"role": "assistant", "content": "", "reasoning_content": "Pondering"}]
    stream = client.chat.completions.create(model=names[0], messages=msgs, stream=True, temperature=0,
                                            max_tokens=8, extra_body={"continue_final_message": "reasoning_content"})
    reasoning = content = ""
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        reasoning += (getattr(delta, "reasoning_content", None) or "") if delta else ""
        content += (delta.content or "") if delta else ""
    assert (reasoning, content) == (MORE, ANSWER)


@pytest.mark.parametrize("body, param", [
    ({"messages": [USER], "continue_final_message": True}, "continue_final_message"),
    ({"messages": [USER, {"role": "assistant", "content": "Hi"}], "continue_final_message": True,
      "add_generation_prompt": True}, "continue_final_message"),
    ({"messages": [USER, {"role": "assistant", "content": "Hi"}], "continue_final_message": "everything"},
     "continue_final_message"),
    ({"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
      "continue_final_message": True}, "continue_final_message"),
    ({"messages": [USER, {"role": "assistant", "content": "Hi"}], "add_generation_prompt": "yes"},
     "add_generation_prompt"),
])
def test_openai_bad_prefill_is_400(server, names, body, param):
    r = _chat(server, {"model": names[0], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_prefill_a_template_cannot_render_is_400(server, names):
    """The tool model's template does not reason: a reasoning continuation is refused in each route's shape."""
    msgs = [USER, {"role": "assistant", "content": "", "reasoning_content": "Pondering"}]
    r = _chat(server, {"model": names[1], "messages": msgs, "continue_final_message": "reasoning_content"})
    assert r.status_code == 400 and "no reasoning to continue" in r.json()["error"]["message"]
    a = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": names[1], "max_tokens": 8, "messages": [USER, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Pondering", "signature": ""}]}]})
    assert a.status_code == 400 and a.json()["type"] == "error"
    assert a.json()["error"]["type"] == "invalid_request_error"


def test_anthropic_prefill(server, names):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    msgs = [USER, {"role": "assistant", "content": "Hello,"}]
    msg = client.messages.create(model=names[0], max_tokens=8, messages=msgs, extra_body={"temperature": 0})
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == CONTINUED
    assert msg.stop_reason == "end_turn"
    with client.messages.stream(model=names[0], max_tokens=8, messages=msgs, extra_body={"temperature": 0}) as stream:
        assert "".join(stream.text_stream) == CONTINUED
    thinking = [USER, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Pondering",
                                                          "signature": ""}]}]
    msg = client.messages.create(model=names[0], max_tokens=8, messages=thinking, extra_body={"temperature": 0})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == \
        [("thinking", MORE), ("text", ANSWER)]


def test_anthropic_prefill_with_tool_use_is_400(server, names):
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": names[0], "max_tokens": 8, "messages": [USER, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "cannot be continued" in r.json()["error"]["message"]


def test_ollama_continues_a_final_assistant_message(server, names):
    r = httpx.post(server.url + "/api/chat", timeout=60, json={
        "model": names[0], "stream": False, "options": {"temperature": 0, "num_predict": 8},
        "messages": [USER, {"role": "assistant", "content": "Hello,"}]})
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == CONTINUED


def test_prompt_opens_thought_sees_prefilled_reasoning():
    from edgeserve.text.reasoning import prompt_opens_thought

    assert prompt_opens_thought("<|im_start|>assistant\n<think>\n")
    assert prompt_opens_thought("<|im_start|>assistant\n<think>\nI'm")  # the thought's text was prefilled
    assert not prompt_opens_thought("<think>\nI'm\n</think>\n\nHello, ")
    assert not prompt_opens_thought("<|im_start|>assistant\n")


def test_no_generation_prompt_renders_the_conversation_alone():
    req = GenerationRequest(model="m", messages=[USER], add_generation_prompt=False)
    template = chat_template("Qwen-Qwen2.5-7B-Instruct.jinja")
    prompt = chat_setup(req, template).prompt
    assert prompt == template.render([USER], add_generation_prompt=False)
    assert prompt.endswith("Hey there!<|im_end|>\n")

"""Qwen3.5's chat: its real template (thinking on and off, tool calls and results written back), its XML tool calls
("qwen3_coder" format) parsed whole and streamed, typed by the tools' schemas, forced through a grammar of the
format itself, and end to end through the four chat routes on scripted models (see scripted_gguf.py).

`qwen35_chat_template.jinja` is Qwen3.5-35B-A3B's chat_template.jinja byte for byte (sha256 a4aee8af...f715,
as published with the model); the small Qwen3.5 models (0.8B-9B) ship the same template with the generation
prompt's default flipped (thinking off unless enable_thinking is true), which `SMALL_SOURCE` rebuilds.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import pytest

from edgeserve.engine.config import EngineConfig
from edgeserve.engine.outputs import RequestOutput
from edgeserve.loaders.chat_template import ChatTemplate
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.tokenizer import tokenizer_from_gguf
from edgeserve.server import ServerConfig
from edgeserve.server.chat_setup import chat_setup
from edgeserve.server.api.ollama import parse_ollama_chat
from edgeserve.server.api.openai import parse_chat_request
from edgeserve.text.grammar import GrammarCompiler, GrammarSpec, allowed_mask, json_rule
from edgeserve.text.formats import detect_format
from edgeserve.text.xml_tool_calls import CALL_TAGS, forced_call_grammar, typed_value
from scripted_gguf import ANSWER, NEWLINE, THOUGHT, TOOL_TEMPLATE, write_scripted_gguf
from server_helpers import post_api, serve
from format_cases import walk as _walk

SOURCE = (Path(__file__).parents[1] / "qwen35_chat_template.jinja").read_text()
OFF_BY_DEFAULT = ("{%- if enable_thinking is defined and enable_thinking is true %}\n        {{- '<think>\\n' }}\n"
                  "    {%- else %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}")
ON_BY_DEFAULT = ("{%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n"
                 "</think>\\n\\n' }}\n    {%- else %}\n        {{- '<think>\\n' }}\n    {%- endif %}")
SMALL_SOURCE = SOURCE.replace(ON_BY_DEFAULT, OFF_BY_DEFAULT)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "metric": {"type": "boolean"}},
                   "required": ["city"]}}}
COUNT = {"type": "function", "function": {"name": "count", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}, "xs": {"type": "array"}}, "required": ["n"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
PARIS = {"city": "Paris"}


def test_fixture_is_the_published_template():
    assert hashlib.sha256(SOURCE.encode()).hexdigest() == (
        "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715")
    assert SMALL_SOURCE != SOURCE and OFF_BY_DEFAULT in SMALL_SOURCE


def test_detects_the_xml_format():
    assert detect_format(SOURCE).name == "qwen3_coder"
    assert detect_format(TOOL_TEMPLATE).name == "hermes"  # <tool_call> JSON templates keep theirs


# --- rendering -----------------------------------------------------------------------------------------------------

def _setup(source: str, body: dict):
    return chat_setup(parse_chat_request({"model": "m", "messages": ASK, **body}, 4), ChatTemplate(source))


@pytest.mark.parametrize("source, body, thinking", [
    (SOURCE, {}, True),
    (SOURCE, {"chat_template_kwargs": {"enable_thinking": False}}, False),
    (SOURCE, {"reasoning_effort": "none"}, False),
    (SOURCE, {"reasoning_effort": "low"}, True),
    (SOURCE, {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, True),
    (SMALL_SOURCE, {}, False),
    (SMALL_SOURCE, {"chat_template_kwargs": {"enable_thinking": True}}, True),
])
def test_thinking_on_and_off(source, body, thinking):
    setup = _setup(source, body)
    if thinking:
        assert setup.prompt.endswith("<|im_start|>assistant\n<think>\n")
        assert setup.thinks and setup.in_thought
    else:
        assert setup.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert not setup.in_thought and setup.thinks  # a thought the model writes anyway is reasoning, not content
        parser = setup.parser()
        (r1, c1), (r2, c2, _) = parser.push("<think>x</think>Hi"), parser.finish()
        assert (r1 + r2, c1 + c2) == ("x", "Hi")


@pytest.mark.parametrize("think", [True, False])
def test_ollama_think_switches_the_template(think):
    req = parse_ollama_chat({"model": "m", "messages": ASK, "think": think})
    prompt = chat_setup(req, ChatTemplate(SMALL_SOURCE)).prompt
    assert prompt.endswith("<think>\n\n</think>\n\n") is not think


HISTORY = ASK + [
    {"role": "assistant", "content": "", "reasoning_content": "They want weather.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2, "opts": {"unit": "C"}}'}},
        {"id": "call_2", "type": "function", "function": {"name": "count", "arguments": '{"n": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "3"},
]


def test_history_calls_and_results_render_as_the_model_writes_them():
    setup = _setup(SOURCE, {"messages": HISTORY, "tools": [WEATHER, COUNT]})
    assert ("<|im_start|>assistant\n<think>\nThey want weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n<parameter=opts>\n"
            '{"unit": "C"}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=count>\n'
            "<parameter=n>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>\n") in setup.prompt
    assert ("<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n3\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n") in setup.prompt
    assert setup.prompt.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:")
    assert json.dumps(WEATHER, ensure_ascii=False) in setup.prompt


@pytest.mark.parametrize("arguments", ['"Paris"', "[1]", "null"])
def test_history_arguments_that_are_no_object_are_a_400(arguments):
    from edgeserve.server.errors import APIError

    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    with pytest.raises(APIError, match="must be a JSON object") as e:
        _setup(SOURCE, {"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [call]}]})
    assert e.value.status == 400 and e.value.param == "messages[1].tool_calls[0].function.arguments"


def test_rendering_matches_transformers():
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                          "arguments": json.loads(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in HISTORY]
    for kwargs in ({}, {"enable_thinking": False}):
        ours = _setup(SOURCE, {"messages": HISTORY, "tools": [WEATHER, COUNT],
                               "chat_template_kwargs": kwargs}).prompt
        theirs, _ = render_jinja_template([messages], tools=[WEATHER, COUNT], chat_template=SOURCE,
                                          add_generation_prompt=True, **kwargs)
        assert ours == theirs[0]


# --- reading replies -----------------------------------------------------------------------------------------------

CALLS_REPLY = ("I will look it up.</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
               "Paris, FR\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
               "<function=count>\n<parameter=n>\n3\n</parameter>\n<parameter=xs>\n[1, 2]\n</parameter>\n</function>\n"
               "</tool_call>")
CALLS = [("get_weather", {"city": "Paris, FR", "days": 2}), ("count", {"n": 3, "xs": [1, 2]})]


def _read(setup, pieces: list[str]):
    """(reasoning, content, calls, streamed content) of a reply pushed in `pieces` through the setup's parser."""
    parser = setup.parser()
    reasoning = content = streamed = ""
    for i, piece in enumerate(pieces):
        out = RequestOutput(request_id="r", text=piece, token_ids=[], logprobs=None,
                            finish_reason="stop" if i == len(pieces) - 1 else None)
        setup.split(parser, out)
        reasoning, content = reasoning + out.reasoning, content + out.text
        if out.finish_reason is None:
            streamed += out.text
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in out.tool_calls], streamed


def test_calls_parse_at_every_split_point():
    setup = _setup(SOURCE, {"tools": [WEATHER, COUNT]})
    assert setup.tools.format.name == "qwen3_coder"
    whole = _read(setup, [CALLS_REPLY])
    assert whole[:3] == ("I will look it up.", "Checking.\n\n", CALLS)  # text before a call streams as it is
    for i in range(1, len(CALLS_REPLY)):
        got = _read(setup, [CALLS_REPLY[:i], CALLS_REPLY[i:]])
        assert got[:3] == whole[:3], i
        assert "<" not in got[3], (i, got[3])  # no marker, nor the start of one, is ever streamed as content
    assert _read(setup, list(CALLS_REPLY))[:3] == whole[:3]


def test_unknown_functions_and_unclosed_blocks_stay_text():
    setup = _setup(SOURCE, {"chat_template_kwargs": {"enable_thinking": False}, "tools": [WEATHER]})
    for reply in ("<tool_call>\n<function=nope>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
                  "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"):
        assert _read(setup, [reply])[1:3] == (reply, [])
    # a closed block whose </tool_call> was cut off, or never written, is a call
    for reply in ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
                  "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>"):
        assert _read(setup, [reply])[1:3] == ("", [("get_weather", PARIS)])


def test_parallel_off_keeps_the_first_call():
    setup = _setup(SOURCE, {"tools": [WEATHER, COUNT], "parallel_tool_calls": False})
    assert _read(setup, [CALLS_REPLY])[2] == CALLS[:1]


@pytest.mark.parametrize("text, schema, value", [
    ("Paris", {"type": "string"}, "Paris"),
    ("42", {"type": "string"}, "42"),
    ("42", {"type": "integer"}, 42),
    ("4.0", {"type": "integer"}, 4),
    ("4.5", {"type": "integer"}, "4.5"),
    ("4.5", {"type": "number"}, 4.5),
    ("many", {"type": "number"}, "many"),
    ("True", {"type": "boolean"}, True),
    ("false", {"type": "boolean"}, False),
    ("null", {"type": ["integer", "null"]}, None),
    ("7", {"type": ["integer", "null"]}, 7),
    ('{"a": [1, true]}', {"type": "object"}, {"a": [1, True]}),
    ("{'a': True}", {"type": "object"}, {"a": True}),  # a dict as the template writes one back
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("[1, 2", {"type": "array"}, "[1, 2"),
    ("3", {"enum": [1, 2, 3]}, 3),
    # a union with string: a value of the other type is that type, anything else a string (llama.cpp's reading)
    ("3", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 3),
    ('{"a": 1}', {"type": ["string", "object"]}, {"a": 1}),
    ("{not valid json", {"type": ["string", "object"]}, "{not valid json"),
    ("2 dollars", {"type": ["string", "integer"]}, "2 dollars"),
    ("42", {"type": ["string", "integer"]}, 42),
    ("null", {"type": ["string", "null"]}, None),
    ("3", {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, 3),
    ("3", None, "3"),
])
def test_values_take_their_schema_type(text, schema, value):
    got = typed_value(text, schema)
    assert got == value and type(got) is type(value)


# --- forced calls through the grammar ------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["tags are tokens", "tags are text"])
def tok(tmp_path_factory, request):
    """A vocabulary with `<tool_call>` / `</tool_call>` as single added tokens and `</`, `parameter`, `>\\n` as
    tokens (as Qwen's), or with none of them."""
    pieces = ([("<tool_call>", "</tool_call>"), ("</", "parameter"), (">\n", "x")] if request.param == "tags are tokens"
              else [("t", "x")])
    path = write_scripted_gguf(tmp_path_factory.mktemp("q") / "vocab.gguf", pieces, SOURCE)
    return tokenizer_from_gguf(GGUFFile(path).metadata)



def _call(name: str, **args: str) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_forced_grammar_accepts_calls_and_refuses_the_rest(tok):
    required = GrammarSpec("lark", forced_call_grammar([WEATHER, COUNT], None, True, json_rule), tokens=CALL_TAGS)
    for reply in (_call("get_weather", city="Paris"), _call("get_weather", city="Paris\nnorth", days="2"),
                  _call("count", n="3", xs="[1, 2]"), _call("count", n="3") + "\n" + _call("get_weather", city="x")):
        state, masked = _walk(tok, required, reply)
        assert masked is None, reply
        assert any(allowed_mask([state], tok.vocab_size)[0, t] for t in tok.eot_ids), reply
    for reply in ("Sure: " + _call("count", n="3"),  # text first
                  _call("get_weather", days="2"),  # a required parameter left out
                  _call("count", n="three"),  # not an integer
                  _call("get_weather", city="Paris", metric="yes"),  # not a boolean
                  _call("get_weather", city="Paris", unit="C"),  # not a parameter of the function
                  _call("nope", a="1")):
        assert _walk(tok, required, reply)[1] is not None, reply
    one = GrammarSpec("lark", forced_call_grammar([WEATHER, COUNT], None, False, json_rule), tokens=CALL_TAGS)
    state, masked = _walk(tok, one, _call("count", n="3"))
    assert masked is None and state.finished
    named = GrammarSpec("lark", forced_call_grammar([WEATHER, COUNT], "get_weather", True, json_rule),
                        tokens=CALL_TAGS)
    assert _walk(tok, named, _call("count", n="3"))[1] is not None
    assert _walk(tok, named, _call("get_weather", city="Paris"))[0].finished


def test_forced_grammar_resolves_refs_to_the_parameters_definitions(tok):
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
             "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "required": ["to"],
        "$defs": {"point": point}}}}
    spec = GrammarSpec("lark", forced_call_grammar([tool], None, False, json_rule), tokens=CALL_TAGS)
    state, masked = _walk(tok, spec, _call("move", to='{"x": 3}'))
    assert masked is None and state.finished
    assert _walk(tok, spec, _call("move", to='{"y": 3}'))[1] is not None
    setup = _setup(SOURCE, {"tools": [tool], "chat_template_kwargs": {"enable_thinking": False}})
    assert _read(setup, [_call("move", to='{"x": 3}')])[2] == [("move", {"to": {"x": 3}})]  # read back as JSON


def test_forced_setup_uses_the_format_after_the_reasoning():
    setup = _setup(SOURCE, {"tools": [WEATHER], "tool_choice": "required"})
    assert setup.constraint.kind == "lark" and setup.constraint.think == ("", "</think>")
    assert "<function=get_weather>" in setup.constraint.source
    assert _read(setup, ["Go.</think>\n\n" + _call("get_weather", city="Paris")])[:3] == (
        "Go.", "", [("get_weather", PARIS)])
    hermes = chat_setup(parse_chat_request({"model": "m", "messages": ASK, "tools": [WEATHER],
                                            "tool_choice": "required"}, 4), ChatTemplate(TOOL_TEMPLATE))
    assert hermes.constraint.kind == "lark" and '"<tool_call>"' in hermes.constraint.source  # hermes: its own


# --- end to end through the four routes ----------------------------------------------------------------------------

# pieces of a Qwen3.5 reply: after the prompt's `<think>\n` (a newline) the model thinks, then answers or calls;
# after `</think>\n\n` (thinking off: a "\n\n" piece) it answers or calls at once. The call in pieces a forced-call
# grammar also allows.
CALL_PIECES = ("<tool_call>", "\n<function=get_weather>\n", "<parameter=city>\n", "Paris", "\n</parameter>\n",
               "</function>\n", "</tool_call>", "<|im_end|>")


def _script(*tokens: str) -> list[tuple[str, str]]:
    return list(zip(tokens, tokens[1:]))


SCRIPTS = {
    "q35-answer": _script(NEWLINE, THOUGHT, "</think>", ANSWER, "<|im_end|>") + [("\n\n", ANSWER)],
    "q35-call": _script(NEWLINE, THOUGHT, "</think>", *CALL_PIECES) + [("\n\n", "<tool_call>")],
}
WEATHER_A = {"name": "get_weather", "description": "Weather in a city",
             "input_schema": WEATHER["function"]["parameters"]}
WEATHER_R = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("q35")
    paths = tuple(str(write_scripted_gguf(d / f"{name}.gguf", script, SOURCE, arch="qwen3", context=4096))
                  for name, script in SCRIPTS.items())
    with serve(ServerConfig(engine=EngineConfig(max_num_seqs=4, kv_cache_gb=0.05), models=paths,
                            keep_alive=None)) as s:
        yield s


def _post(server, path, body, stream=False):
    return post_api(server, path, body if "input" in body else {"messages": ASK, **body}, stream)


def _no_markup(obj) -> None:
    text = json.dumps(obj, ensure_ascii=False)
    assert not any(m in text for m in ("<tool_call>", "<function=", "<parameter=", "</think>")), text


def test_openai_chat(server):
    msg = _post(server, "/v1/chat/completions", {"model": "q35-answer"})["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (THOUGHT, ANSWER)
    msg = _post(server, "/v1/chat/completions", {"model": "q35-answer", "reasoning_effort": "none"})["choices"][0]
    assert msg["message"]["content"] == ANSWER and not msg["message"].get("reasoning_content")
    for body in ({}, {"tool_choice": "required"}, {"tool_choice": {"type": "function",
                                                                    "function": {"name": "get_weather"}}},
                 {"chat_template_kwargs": {"enable_thinking": False}}):
        choice = _post(server, "/v1/chat/completions", {"model": "q35-call", "tools": [WEATHER], **body})["choices"][0]
        assert choice["finish_reason"] == "tool_calls", body
        (call,) = choice["message"]["tool_calls"]
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", PARIS)
        assert not choice["message"]["content"]
        assert choice["message"].get("reasoning_content") == (None if body.get("chat_template_kwargs") else THOUGHT)
    chunks = _post(server, "/v1/chat/completions", {"model": "q35-call", "tools": [WEATHER]}, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("get_weather", PARIS)]
    _no_markup(chunks)


def test_multi_turn_with_tool_results_continues(server):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    choice = _post(server, "/v1/chat/completions", {"model": "q35-answer", "messages": history,
                                                     "tools": [WEATHER]})["choices"][0]
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == (THOUGHT, ANSWER)


def test_ollama_chat(server):
    msg = _post(server, "/api/chat", {"model": "q35-answer", "stream": False})["message"]
    assert (msg["thinking"], msg["content"]) == (THOUGHT, ANSWER)
    msg = _post(server, "/api/chat", {"model": "q35-answer", "think": False, "stream": False})["message"]
    assert msg["content"] == ANSWER and "thinking" not in msg
    lines = _post(server, "/api/chat", {"model": "q35-call", "tools": [WEATHER]}, stream=True)
    assert [c for line in lines for c in line["message"].get("tool_calls", [])] == [
        {"function": {"name": "get_weather", "arguments": PARIS}}]
    assert "".join(line["message"].get("thinking", "") for line in lines) == THOUGHT
    _no_markup(lines)


def test_anthropic_messages(server):
    reply = _post(server, "/v1/messages", {"model": "q35-call", "max_tokens": 64, "tools": [WEATHER_A]})
    assert reply["stop_reason"] == "tool_use"
    assert [(b["type"], b.get("name"), b.get("input")) for b in reply["content"]] == [
        ("thinking", None, None), ("tool_use", "get_weather", PARIS)]
    reply = _post(server, "/v1/messages", {"model": "q35-call", "max_tokens": 64, "tools": [WEATHER_A],
                                           "tool_choice": {"type": "tool", "name": "get_weather"},
                                           "thinking": {"type": "disabled"}})
    assert [(b["type"], b.get("input")) for b in reply["content"]] == [("tool_use", PARIS)]
    _no_markup(_post(server, "/v1/messages", {"model": "q35-call", "max_tokens": 64, "tools": [WEATHER_A]},
                     stream=True))


def test_responses(server):
    out = _post(server, "/v1/responses", {"model": "q35-call", "input": "Weather in Paris?", "tools": [WEATHER_R],
                                          "tool_choice": "required"})["output"]
    assert [i["type"] for i in out] == ["reasoning", "function_call"]
    assert (out[1]["name"], json.loads(out[1]["arguments"])) == ("get_weather", PARIS)
    out = _post(server, "/v1/responses", {"model": "q35-answer", "input": "Hi", "reasoning": {"effort": "none"}})
    assert [i["type"] for i in out["output"]] == ["message"]
    assert out["output"][0]["content"][0]["text"] == ANSWER


def test_ollama_show_lists_thinking_and_tools(server):
    caps = httpx.post(server.url + "/api/show", json={"model": "q35-call"}, timeout=30).json()["capabilities"]
    assert {"completion", "tools", "thinking"} <= set(caps)

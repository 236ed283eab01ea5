"""A forced tool call (tool_choice "required" and a named function) in every registered reply format is the
format's own syntax, and what the grammar alone lets a random model write reads back as calls valid against the
tools' schemas.

For each format: the request goes through chat_setup with a llama.cpp template of that family (so the thought the
prompt opens and the reply parsing are the server's), the constraint is walked by uniformly random tokens over a
small vocabulary in which the format's markup are single special tokens (format_cases.random_reply), and the reply
goes back through ChatSetup.split. gpt-oss goes through its harmony path the same way. Then Gemma 4 (strings
delimited by a special token) and hermes run through the real engine and server on a tiny random-weight model
with the openai client, whole and cut short by max_tokens.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import openai
import pytest

from edgeserve.engine.config import EngineConfig
from edgeserve.engine.outputs import RequestOutput
from edgeserve.errors import ChatTemplateError
from edgeserve.loaders.chat_template import ChatTemplate
from edgeserve.server import ServerConfig
from edgeserve.server.chat_setup import ChatSetup, chat_setup
from edgeserve.server.request import GenerationRequest
from edgeserve.text.formats import all_formats
from edgeserve.text.harmony import MARKERS
from format_cases import detections, random_reply, templates, tool, vocabulary
from llama_cpp_source import llama_cpp_dir
from scripted_gguf import TOOL_TEMPLATE, write_scripted_gguf
from server_helpers import serve

# finite values only: a random walk through free text would rarely write a closing tag spelled as text
PICK = tool("pick", {"color": {"enum": ["red", "green"]}, "on": {"type": "boolean"}}, ["color", "on"])
COUNT = tool("count", {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "loud": {"type": "boolean"}}, ["n"])
TOOLS = [PICK, COUNT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Pick one."}]
FORMATS = all_formats()
CHOICES = {"required": None, "named": "count"}
# known gaps of other format modules (found by this test; non-strict, so their fixes need only drop the entry)
GAPS: dict[tuple[str, str], str] = {}


def _cases() -> list:
    return [pytest.param(fmt, choice, id=f"{fmt.name}-{key}",
                         marks=[pytest.mark.xfail(reason=GAPS[fmt.name, key], strict=False)]
                         if (fmt.name, key) in GAPS else [])
            for fmt in FORMATS for key, choice in CHOICES.items()]


def _format_setup(name: str, choice: str | None) -> ChatSetup:
    """The setup of a forced request on the first llama.cpp template detected as format `name` that renders our
    request (firefunction's wants variables of its own); a ChatML one otherwise."""
    found = sorted(t for t, f in detections().items() if f == name)
    assert found, f"no llama.cpp template is detected as {name}"
    for source in [templates()[t] for t in found] + [TOOL_TEMPLATE]:
        try:
            return _setup(ChatTemplate(source, "<s>", "</s>"), choice, name)
        except ChatTemplateError:
            continue


def _setup(template: ChatTemplate, choice: str | None, fmt: str | None = None) -> ChatSetup:
    tool_choice = "required" if choice is None else {"type": "function", "name": choice}
    req = GenerationRequest(model="m", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                            parallel_tool_calls=choice is None)
    return chat_setup(req, template, tool_format=fmt)


def _specials(setup: ChatSetup) -> tuple[str, ...]:
    """The markup that is one special token in the family's vocabulary: what the grammar quotes as a token, and
    the reasoning tags without spaces."""
    tags = {t for t in (setup.constraint.think or ()) if t and not any(c.isspace() for c in t)}
    return tuple(sorted(set(setup.constraint.tokens) | tags))


def _read(setup: ChatSetup, reply: str, finish: str = "stop") -> RequestOutput:
    out = RequestOutput(request_id="r", text=reply, token_ids=[], logprobs=None, finish_reason=finish)
    setup.split(setup.parser(), out)
    return out


def _check_calls(out: RequestOutput, choice: str | None, reply: str) -> None:
    assert out.tool_calls and out.text.strip() == "" and out.finish_reason == "tool_calls", reply
    for call in out.tool_calls:
        assert call.name == choice if choice else call.name in SCHEMAS, reply
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    if choice is not None:
        assert len(out.tool_calls) == 1


@pytest.mark.parametrize("fmt,choice", _cases())
def test_a_random_model_under_the_forced_grammar_writes_calls_that_read_back(tmp_path, fmt, choice):
    setup = _format_setup(fmt.name, choice)
    assert setup.tools.format is fmt and setup.constraint.kind == "lark"  # the format's own grammar
    assert dataclasses.replace(setup.constraint, think=None) == fmt.forced(TOOLS, choice, choice is None)
    tok = vocabulary(tmp_path, _specials(setup))
    think = setup.constraint.think
    thought = f"{think[0]}Let me pick.{think[1]}" if think else ""
    for seed in range(3):
        reply = random_reply(tok, setup.constraint, seed, prefix=thought)
        _check_calls(_read(setup, reply), choice, reply)


def test_muse_glimmer_thought_before_a_forced_call_is_reasoning():
    setup = _format_setup("muse_glimmer", None)
    assert setup.constraint.think is None  # its grammar covers the thought (own_thought)
    call = ('<atem:function_calls>\n<atem:invoke name="count">\n<atem:parameter name="n">6</atem:parameter>\n'
            '</atem:invoke>\n</atem:function_calls>')
    reply = f" to=self<|message|>I think.<|eom|><|start|>assistant to=count<|message|>{call}"
    out = _read(setup, reply)
    assert out.reasoning == "I think." and out.text == "" and [c.name for c in out.tool_calls] == ["count"]


@pytest.mark.parametrize("choice", CHOICES.values(), ids=CHOICES.keys())
def test_gpt_oss_forced_call_through_harmony(tmp_path, choice):
    source = (Path(__file__).parents[1] / "gpt_oss_chat_template.jinja").read_text()
    setup = _setup(ChatTemplate(source), choice)
    assert setup.harmony and setup.constraint.kind == "lark"
    tok = vocabulary(tmp_path, tuple(MARKERS))
    for seed in range(3):
        reply = random_reply(tok, setup.constraint, seed)
        _check_calls(_read(setup, reply), choice, reply)


# --- through the engine and the server -----------------------------------------------------------------------------

GEMMA4_MARKUP = ("<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>", "<|channel>", "<channel|>", "<|turn>",
                 "<turn|>")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    d = tmp_path_factory.mktemp("random")
    gemma = (llama_cpp_dir() / "models" / "templates" / "google-gemma-4-31B-it.jinja").read_text()
    models = (write_scripted_gguf(d / "gemmaish.gguf", [("t", "x")], gemma, specials=GEMMA4_MARKUP,
                                  context=4096, noise=1.0),
              write_scripted_gguf(d / "qwenish.gguf", [("t", "x")], TOOL_TEMPLATE, specials=("<tool_call>",
                                  "</tool_call>"), context=4096, noise=1.0))
    with serve(ServerConfig(engine=EngineConfig(max_num_seqs=2, kv_cache_gb=0.05), models=tuple(map(str, models)),
                            keep_alive=None)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("model", ["gemmaish", "qwenish"])
def test_required_call_from_a_random_model_through_the_server(client, model):
    for seed in range(2):
        r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=200)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls  # parallel_tool_calls unset: one call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_call_cut_by_max_tokens_comes_back_with_its_arguments_so_far(client):
    # `<|tool_call>`, then "call:count{" byte by byte, then "n:": the cut falls inside the arguments
    r = client.chat.completions.create(model="gemmaish", messages=ASK, tools=TOOLS, temperature=1.0, seed=0,
                                       tool_choice={"type": "function", "function": {"name": "count"}},
                                       max_tokens=14)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "count" and call.function.arguments.startswith('{"')


# --- the four formats that used to fall back to a JSON wrapper: their grammars and cut calls -----------------------

CUTS = {
    "hermes": ('<tool_call>\n{"name": "pick", "arguments": {"color": "red", "on": true}}\n</tool_call>\n'
               '<tool_call>\n{"name": "count", "arguments": {"n": 3, "lo', '{"n": 3, "lo'),
    "mistral": ('[TOOL_CALLS][{"name": "pick", "arguments": {"color": "red", "on": true}, "id": "a1b2c3d4e"}, '
                '{"name": "count", "arguments": {"n": 3, "lo', '{"n": 3, "lo'),
    "llama3": ('{"name": "pick", "parameters": {"color": "red", "on": true}}; {"name": "count", "parameters": {"n": 3, '
               '"lo', '{"n": 3, "lo'),
    "gemma4": ('<|tool_call>call:pick{color:<|"|>red<|"|>,on:true}<tool_call|>'
               '<|tool_call>call:count{loud:true,n:<|"|>3',
               '{"loud":true,"n":"3'),
}


@pytest.mark.parametrize("name", sorted(CUTS))
def test_a_forced_reply_cut_short_keeps_its_calls_and_the_cut_ones_arguments(name):
    text, partial = CUTS[name]
    setup = _format_setup(name, None)
    out = _read(setup, text, finish="length")
    assert out.finish_reason == "length" and out.text == ""
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("pick", '{"color": "red", "on": true}'),
                                                                ("count", partial)]
    if name == "mistral":  # the id the model wrote is the call's id
        assert out.tool_calls[0].id == "a1b2c3d4e"
    # not even the name: nothing to call, the text stays
    head = text[:text.index("pick") + 2]
    out = _read(setup, head, finish="length")
    assert out.tool_calls == [] and out.text.strip() == head.strip()


NESTED = {"type": "function", "function": {"name": "plan", "parameters": {
    "type": "object", "required": ["steps", "zip"],
    "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "note": {"type": "string", "maxLength": 3},
                   "steps": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"$ref": "#/$defs/step"}},
                   "odd key": {"type": "integer"}},
    "$defs": {"step": {"type": "object", "properties": {"say": {"type": "string"},
                                                        "then": {"$ref": "#/$defs/step"}},
                       "required": ["say"], "additionalProperties": False}}}}}
STEP = '{say:<|"|>hi, {x:1}<|"|>,then:{say:<|"|><|"|>}}'


@pytest.mark.parametrize("text,ok", [
    (f'<|tool_call>call:plan{{note:<|"|>abc<|"|>,<|"|>odd key<|"|>:4,steps:[{STEP}],zip:<|"|>12345<|"|>}}<tool_call|>',
     True),
    (f'<|tool_call>call:plan{{steps:[{STEP},{STEP}],zip:<|"|>00000<|"|>}}<tool_call|>', True),
    (f'<|tool_call>call:plan{{steps:[{STEP},{STEP},{STEP}],zip:<|"|>00000<|"|>}}<tool_call|>', False),  # maxItems
    ('<|tool_call>call:plan{steps:[],zip:<|"|>00000<|"|>}<tool_call|>', False),  # minItems
    (f'<|tool_call>call:plan{{steps:[{STEP}],zip:<|"|>0000<|"|>}}<tool_call|>', False),  # pattern
    (f'<|tool_call>call:plan{{note:<|"|>abcd<|"|>,steps:[{STEP}],zip:<|"|>00000<|"|>}}<tool_call|>', False),  # length
    (f'<|tool_call>call:plan{{zip:<|"|>00000<|"|>,steps:[{STEP}]}}<tool_call|>', False),  # keys in sorted order
    ('<|tool_call>call:plan{steps:[{say:<|"|>a<|"|>,x:1}],zip:<|"|>00000<|"|>}<tool_call|>', False),  # no extras
])
def test_gemma4_arguments_follow_the_schema(tmp_path_factory, text, ok):
    from format_cases import accepts, context

    fmt = next(f for f in FORMATS if f.name == "gemma4")
    spec = fmt.forced([NESTED], "plan", False)
    tok = vocabulary(tmp_path_factory.mktemp("g4"), spec.tokens)
    assert accepts(tok, spec, text) == ok
    if ok:
        (call,) = fmt.parse(text, context([NESTED]))[1]
        jsonschema.validate(json.loads(call.arguments), NESTED["function"]["parameters"])


def test_gemma4_forced_grammar_on_gemma4s_own_vocabulary():
    from edgeserve.loaders.gguf_file import GGUFFile
    from edgeserve.loaders.tokenizer import tokenizer_from_gguf
    from format_cases import accepts, walk

    tok = tokenizer_from_gguf(GGUFFile(llama_cpp_dir() / "models" / "ggml-vocab-gemma-4.gguf").metadata)
    spec = next(f for f in FORMATS if f.name == "gemma4").forced(TOOLS, None, True)
    call = '<|tool_call>call:pick{color:<|"|>green<|"|>,on:false}<tool_call|>'
    assert len(tok.encode('<|"|>', add_special_tokens=False)) == 1  # the delimiter is one token there
    assert accepts(tok, spec, call) and accepts(tok, spec, call * 2)
    assert walk(tok, spec, call.replace("green", "blue"))[1] is not None

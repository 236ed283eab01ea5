"""Grammars, reasoning split and tool-call parsing without a model: the pieces structured output is built from."""

from __future__ import annotations

import json

import pytest
import torch

from edgeserve.engine.runner.sampler import sample_tokens
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.tokenizer import tokenizer_from_gguf
from edgeserve.sampling_params import SamplingParams
from edgeserve.text.chat_output import ChatOutputParser, ToolSetup
from edgeserve.text.grammar import GrammarCompiler, GrammarError, GrammarSpec, allowed_mask
from edgeserve.text.reasoning import ReasoningSplitter
from edgeserve.text.formats import CallContext, get_format
from edgeserve.text.tool_calls import forced_schema, messages_for_template, parse_forced, tools_system_prompt
from tiny_gguf import write_tiny_llama

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("g") / "tiny.gguf")
    return tokenizer_from_gguf(GGUFFile(path).metadata)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler.for_tokenizer(tok, tok.vocab_size)


def _walk(compiler, tok, spec, text):
    """Consume `text` token by token, checking each token was allowed by the mask before it."""
    state = compiler.start(spec)
    for t in tok.encode(text, add_special_tokens=False):
        assert allowed_mask([state], tok.vocab_size)[0, t], f"token {t} of {text!r} was masked"
        assert state.accept([t])
    return state


def test_compiled_once_and_cached(compiler, tok):
    spec = GrammarSpec.json_schema(SCHEMA)
    assert compiler.compile(spec) is compiler.compile(GrammarSpec.json_schema(json.loads(json.dumps(SCHEMA))))
    assert GrammarCompiler.for_tokenizer(tok, tok.vocab_size) is compiler


def test_mask_follows_the_schema_and_eos_only_at_the_end(compiler, tok):
    state = _walk(compiler, tok, GrammarSpec.json_schema(SCHEMA), '{"a": 12, "b": "yy"}')
    allowed = allowed_mask([state], tok.vocab_size)[0]
    assert state.finished and set(allowed.nonzero().flatten().tolist()) <= set(tok.eot_ids)
    half = _walk(compiler, tok, GrammarSpec.json_schema(SCHEMA), '{"a": 1')
    mask = allowed_mask([half], tok.vocab_size)[0]
    assert not any(mask[t] for t in tok.eot_ids)  # unfinished JSON may not end
    assert not mask[tok.encode("x", add_special_tokens=False)[0]]


def test_unsupported_schema_feature_is_named(compiler):
    with pytest.raises(GrammarError, match="not"):
        compiler.compile(GrammarSpec.json_schema({"type": "object", "not": {"required": ["a"]}}))


def test_reasoning_comes_before_the_constraint(compiler, tok):
    spec = GrammarSpec.json_schema(SCHEMA, think=("<think>", "</think>"))
    state = _walk(compiler, tok, spec, '<think>free {text</think>\n{"a": 1, "b": "x"}')
    assert state.finished
    opened = GrammarSpec.json_schema(SCHEMA, think=("", "</think>"))
    assert _walk(compiler, tok, opened, 'no tag yet</think>{"a": 1, "b": "x"}').finished


def test_sampler_masks_only_constrained_rows(compiler, tok):
    torch.manual_seed(0)
    logits = torch.randn(3, tok.vocab_size)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, json_schema=SCHEMA),
              SamplingParams(temperature=1.0, json_object=True)]
    states = [None, compiler.start(params[1].grammar), compiler.start(params[2].grammar)]
    out = sample_tokens(logits.clone(), params, [None] * 3, grammars=states).token_ids.tolist()
    assert out[0] == logits[0].argmax().item()
    for row, state in ((1, states[1]), (2, states[2])):
        assert allowed_mask([state], tok.vocab_size)[0, out[row]]


def test_sampling_params_shorthands():
    assert SamplingParams(json_schema=SCHEMA).grammar == GrammarSpec.json_schema(SCHEMA)
    assert SamplingParams(json_object=True).grammar.kind == "json_object"
    with pytest.raises(ValueError, match="exclusive"):
        SamplingParams(json_schema=SCHEMA, json_object=True)


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7])
def test_reasoning_split_streams_like_whole(cut):
    text = "<think>step one\nstep two</think>\n\nThe answer."
    whole = ReasoningSplitter()
    r, c = whole.push(text)
    r2, c2 = whole.flush()
    assert (r + r2, c + c2) == ("step one\nstep two", "The answer.")
    s, got_r, got_c = ReasoningSplitter(), "", ""
    for i in range(0, len(text), cut):
        a, b = s.push(text[i:i + cut])
        got_r, got_c = got_r + a, got_c + b
    a, b = s.flush()
    assert (got_r + a, got_c + b) == ("step one\nstep two", "The answer.")


def test_reasoning_opened_by_the_prompt_and_plain_text():
    s = ReasoningSplitter(in_thought=True)
    assert s.push("thinking</think>answer") == ("thinking", "answer")
    plain = ReasoningSplitter()
    assert plain.push("no tags <think> here") == ("", "no tags <think> here")


@pytest.mark.parametrize("fmt,text,content", [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
               '<tool_call>{"name": "g", "arguments": {}}</tool_call>', "Sure."),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]', ""),
    ("llama3", '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', ""),
])
def test_tool_call_formats(fmt, text, content):
    got, calls = get_format(fmt).parse(text, CallContext({"f", "g"}))
    assert got == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert calls[0].id != calls[1].id


def test_unknown_function_stays_text():
    text = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert get_format("hermes").parse(text, CallContext({"f"})) == (text, [])


@pytest.mark.parametrize("cut", [1, 4, 9])
def test_chat_output_parser_holds_calls_back(cut):
    text = 'Let me check.<tool_call>{"name": "f", "arguments": {"x": 2}}</tool_call>'
    parser = ChatOutputParser(None, ToolSetup("auto", "hermes", {"f"}))
    shown = ""
    for i in range(0, len(text), cut):
        shown += parser.push(text[i:i + cut])[1]
        assert "<" not in shown  # nothing of the call is ever streamed as content
    _, rest, calls = parser.finish()
    assert shown + rest == "Let me check."
    assert [c.name for c in calls] == ["f"]


def test_forced_schema_and_parse():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    one = forced_schema(tools, None, parallel=False)
    assert one["maxItems"] == 1 and one["minItems"] == 1
    calls = parse_forced('[{"name": "g", "arguments": {"k": 1}}]', None)
    assert (calls[0].name, json.loads(calls[0].arguments)) == ("g", {"k": 1})
    assert forced_schema(tools, "f", True) == {"type": "object"}
    assert parse_forced('{"k": 1}', "f")[0].name == "f"


def test_tools_go_into_the_system_prompt_for_templates_without_tools():
    tools = [{"type": "function", "function": {"name": "f"}}]
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    out = messages_for_template(msgs, tools, "{{ messages }}")
    assert out[0] == {"role": "system", "content": tools_system_prompt(tools)}
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>' in out[2]["content"]
    assert out[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}


def test_a_broken_grammar_state_can_only_end(compiler, tok):
    state = compiler.start(GrammarSpec("json_object"))
    assert not state.accept(tok.encode("xx", add_special_tokens=False))
    assert state.error
    assert set(allowed_mask([state], tok.vocab_size)[0].nonzero().flatten().tolist()) == set(tok.eot_ids)

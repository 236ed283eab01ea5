"""LFM2 / LFM2.5 pythonic tool calls (edgeserve.text.formats.lfm2): llama.cpp's own LFM2 parser cases
(tests/data/chat_formats/lfm2.json, from test-chat.cpp's test_lfm2_parser and LFM2.5 blocks) read whole and
streamed, detection over llama.cpp's 70 templates, the parser's edges (never eval, never lose text), and the
forced-call grammar walked token by token: it admits calls, refuses junk, and what it admits reads back."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from chat_cpp_inputs import input_at
from edgeserve.loaders.gguf_file import GGUFFile
from edgeserve.loaders.tokenizer import tokenizer_from_gguf
from edgeserve.text.formats import CallContext, detect_format, get_format
from edgeserve.text.formats.lfm2 import CALL_END, CALL_START, forced_grammar, literal, parse_calls
from edgeserve.text.grammar import GrammarCompiler, allowed_mask
from edgeserve.text.reasoning import ReasoningSplitter, reasoning_tags
from llama_cpp_source import llama_cpp_dir
from scripted_gguf import write_scripted_gguf
from format_cases import walk as _walk

CASES = json.loads((Path(__file__).parents[1] / "data" / "chat_formats" / "lfm2.json").read_text())
LFM = ("LFM2-8B-A1B.jinja", "LFM2.5-Instruct.jinja", "LFM2.5-8B-A1B.jinja")
FMT = get_format("lfm2")


def _template(name: str) -> str:
    return (llama_cpp_dir() / "models" / "templates" / name).read_text()


def _ctx(tools: list[dict]) -> CallContext:
    fns = [t["function"] for t in tools]
    return CallContext({f["name"] for f in fns}, {f["name"]: f.get("parameters") or {} for f in fns})


def _read(template: str, pieces: list[str], ctx: CallContext) -> tuple[str, str, list[tuple[str, str]]]:
    """A reply as the server reads one of this format: reasoning split off first (the template's tags), content
    from the first call marker on handed to the format's parser."""
    tags = FMT.reasoning or reasoning_tags(_template(template))
    splitter = ReasoningSplitter(open_tag=tags[0], close_tag=tags[1]) if tags else None
    reasoning = content = ""
    for piece in pieces:
        r, c = splitter.push(piece) if splitter else ("", piece)
        reasoning, content = reasoning + r, content + c
    if splitter:
        r, c = splitter.flush()
        reasoning, content = reasoning + r, content + c
    starts = [i for m in FMT.call_markers if (i := content.find(m)) >= 0]
    if not starts:
        return reasoning, content, []
    rest, calls = FMT.parse(content[min(starts):], ctx)
    return reasoning, content[:min(starts)] + rest, [(c.name, c.arguments) for c in calls]


def _case_id(case: dict) -> str:
    return f"{case['template']}:{case['line']}"


@pytest.mark.parametrize("case", [c for c in CASES if not c["is_partial"]], ids=_case_id)
def test_llama_cpp_cases_whole_and_streamed(case):
    want = case["expect"]
    text, ctx = case["input"], _ctx(case["tools"])
    expected = (want["reasoning_content"], want["content"], [(c["name"], c["arguments"]) for c in want["tool_calls"]])
    assert _read(case["template"], [text], ctx) == expected
    assert _read(case["template"], list(text), ctx) == expected
    for i in range(1, len(text), 3):
        assert _read(case["template"], [text[:i], text[i:]], ctx) == expected, f"split at {i}"


def test_a_call_cut_mid_stream_stays_text():
    """llama.cpp's partial case (a reply cut inside a call) shows the call as far as it got; here the reply is
    read at its end, and a call that never closed comes back as the text it was: nothing is lost."""
    partial = [c for c in CASES if c["is_partial"]]
    assert len(partial) == 3  # the one case, on each template
    for case in partial:
        assert _read(case["template"], [case["input"]], _ctx(case["tools"])) == ("", case["input"], [])


def test_cases_quote_the_reference():
    """Every case's input is the text its test-chat.cpp line passes to `tst.test(`, every template is covered and
    every whole call's arguments are JSON as edgeserve writes it."""
    assert {c["template"] for c in CASES} == set(LFM)
    for case in CASES:
        assert input_at(case["line"]) == case["input"], _case_id(case)
        for call in [] if case["is_partial"] else case["expect"]["tool_calls"]:
            assert json.dumps(json.loads(call["arguments"]), ensure_ascii=False) == call["arguments"]


# --- detection ---------------------------------------------------------------------------------------------------

def test_detects_the_three_lfm_templates_and_no_other():
    templates = sorted((llama_cpp_dir() / "models" / "templates").glob("*.jinja"))
    assert len(templates) >= 70
    found = {p.name for p in templates if FMT.detect(p.read_text())}
    assert found == set(LFM)
    for name in LFM:
        assert detect_format(_template(name)).name == "lfm2"


# --- the parser's edges --------------------------------------------------------------------------------------------

KNOWN = CallContext({"f", "g", "Calendar.create_event", "get-time"})


def _calls(text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse_calls(text, KNOWN)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def _block(body: str) -> str:
    return f"{CALL_START}{body}{CALL_END}"


@pytest.mark.parametrize("body, calls", [
    ('[f(a=1, b="x", c=True, d=None, e={"k": 1})]', [("f", {"a": 1, "b": "x", "c": True, "d": None, "e": {"k": 1}})]),
    ("[f(a='single', b=-2.5, c=[1, (2, 3)], d=1e3)]",
     [("f", {"a": "single", "b": -2.5, "c": [1, [2, 3]], "d": 1000.0})]),
    ('[f(a="x, y) ]"), g()]', [("f", {"a": "x, y) ]"}), ("g", {})]),
    ('[ f( a = 1 , ) ,g(b="""tri"ple""") ]', [("f", {"a": 1}), ("g", {"b": 'tri"ple'})]),
    ('[Calendar.create_event(title="demo")]', [("Calendar.create_event", {"title": "demo"})]),
    ("[get-time(city='Paris')]", [("get-time", {"city": "Paris"})]),
    ('f(a=1)', [("f", {"a": 1})]),  # no brackets around one call
    ("[f(a={'k': null, 'j': false})]", [("f", {"a": {"k": None, "j": False}})]),
    ("[f(a=1e999, b=-2e400, c={1: 'x'})]", [("f", {"a": float("inf"), "b": float("-inf"), "c": {"1": "x"}})]),
])
def test_reads_calls(body, calls):
    assert _calls(_block(body)) == ("", calls)


@pytest.mark.parametrize("body", [
    '[f(a=__import__("os").system("echo hi"))]',  # not a literal: never run
    "[f(a=open('/etc/passwd'))]", "[f(a=x)]", "[f(a=1 + 2)]",
    "[f(1)]",  # positional
    "[f(a={1, 2})]", "[f(a=b'x')]", "[f(a=1j)]", '[f(a="\\ud800")]', "[f(a={(1, 2): 3})]",  # no JSON for these
    "[f(a=1)", "[f(a=1))]", "[f(a=[1)]", "[]", "", "[f(a=1)] and more", "[f(a=1); g()]",
    "[f(a=" + "[" * 500 + "]" * 500 + ")]",  # nested past the parser's limit
    "[f(a=1), h(b=2)]",  # h was not offered: the whole block stays text
])
def test_malformed_or_unknown_blocks_stay_text(body):
    text = "Before " + _block(body) + " after"
    assert parse_calls(text, KNOWN) == (text, [])


def test_text_between_blocks_is_kept_and_a_bad_block_does_not_spoil_a_good_one():
    text = _block("[f(a=1)]") + " middle " + _block("[nope()]") + " end " + _block("[g(b=2)]")
    content, calls = _calls(text)
    assert content == "middle " + _block("[nope()]") + " end"
    assert calls == [("f", {"a": 1}), ("g", {"b": 2})]


def test_an_unclosed_block_with_a_whole_list_is_a_call():
    assert _calls(CALL_START + '[f(a="cut here")]') == ("", [("f", {"a": "cut here"})])


def test_literal_is_never_code():
    assert literal("{'a': [True, None, null]}") == {"a": [True, None, None]}
    for text in ("__import__('os')", "print(1)", "(lambda: 1)()", "[x for x in ()]", "a.b"):
        with pytest.raises(ValueError):
            literal(text)


# --- forced calls through the grammar ----------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city"]}}}
EVENT = {"type": "function", "function": {"name": "Calendar.create_event", "parameters": {
    "type": "object", "properties": {"note": {"type": ["string", "null"]}, "tags": {"type": "array",
                                                                                   "items": {"type": "string"}},
                                     "title": {"type": "string"}},
    "required": ["title"]}}}
FREE = {"type": "function", "function": {"name": "anything", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, EVENT, FREE]


@pytest.fixture(scope="module", params=["tags are tokens", "tags are text"])
def tok(tmp_path_factory, request):
    specials = (CALL_START, CALL_END) if request.param == "tags are tokens" else ()
    path = write_scripted_gguf(tmp_path_factory.mktemp("lfm") / "vocab.gguf", [("t", "x")], _template(LFM[2]),
                               specials=specials)
    return tokenizer_from_gguf(GGUFFile(path).metadata)



def _admits(tok, spec, text) -> bool:
    state, masked = _walk(tok, spec, text)
    return masked is None and any(allowed_mask([state], tok.vocab_size)[0, t] for t in tok.eot_ids)


@pytest.mark.parametrize("body", [
    '[get_weather(city="Paris")]',
    "[get_weather(city='Paris', days=3, metric=True, unit=\"F\")]",
    '[get_weather(city="a \\"quoted\\" \\u00e9 city", metric=false)]',
    '[get_weather(city="Oslo"), Calendar.create_event(note=None, title="x")]',
    '[Calendar.create_event(note="n", tags=["a", "b"], title="t")]',
    '[anything()]', '[anything(k={"a": [1, null]}, j="s")]',
])
def test_forced_grammar_admits_calls_that_read_back(tok, body):
    spec = forced_grammar(TOOLS, None, True)
    assert _admits(tok, spec, _block(body)), body
    assert parse_calls(_block(body), _ctx(TOOLS))[1], body


@pytest.mark.parametrize("body", [
    "Sure: [get_weather(city='x')]",  # text first
    "[get_weather(days=2)]",  # the required argument left out
    "[get_weather(city='x', days='two')]",  # not an integer
    "[get_weather(city='x', metric=yes)]",  # not a boolean
    "[get_weather(city='x', unit='K')]",  # not in the enum
    "[get_weather(city='x', wind=1)]",  # not a parameter
    "[get_weather(days=1, city='x')]",  # out of the schema's order
    "[get_weather('x')]",  # positional
    "[get_weather(city='x\\N{BULLET}')]",  # an escape the parser would refuse
    "[nope()]",
])
def test_forced_grammar_refuses_junk(tok, body):
    assert not _admits(tok, forced_grammar(TOOLS, None, True), _block(body)), body


def test_forced_grammar_named_and_single_call(tok):
    named = forced_grammar(TOOLS, "get_weather", True)
    assert _admits(tok, named, _block("[get_weather(city='x')]"))
    assert not _admits(tok, named, _block("[anything()]"))
    assert not _admits(tok, named, _block("[get_weather(city='x'), get_weather(city='y')]"))
    one = forced_grammar(TOOLS, None, False)
    assert _admits(tok, one, _block("[anything()]"))
    assert not _admits(tok, one, _block("[anything(), anything()]"))
    assert _walk(tok, one, _block("[anything()]"))[0].finished


def test_forced_grammar_after_a_thought(tok):
    """LFM2.5-8B-A1B thinks first: with the reasoning tags set on the spec, the thought is free and the call
    follows it."""
    spec = replace(forced_grammar(TOOLS, "get_weather", True), think=("<think>", "</think>"))
    assert _admits(tok, spec, "<think>Paris, surely.</think>" + _block("[get_weather(city='Paris')]"))
    assert not _admits(tok, spec, "<think>Paris, surely.</think>Sure.")


def test_forced_grammar_resolves_refs_to_the_parameters_definitions(tok):
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
             "additionalProperties": False}
    move = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}, "why": {"type": "string", "nullable": True}},
        "required": ["to"], "$defs": {"point": point}}}}
    spec = forced_grammar([move], None, False)
    assert _admits(tok, spec, _block('[move(to={"x": 3}, why=None)]'))
    assert _admits(tok, spec, _block("[move(to={\"x\": 3}, why='go')]"))
    assert not _admits(tok, spec, _block('[move(to={"y": 3})]'))
    assert parse_calls(_block('[move(to={"x": 3}, why=None)]'), _ctx([move]))[1][0].arguments == \
        '{"to": {"x": 3}, "why": null}'


def test_random_walks_through_the_grammar_read_back(tok):
    """Replies drawn at random from what the grammar allows, token by token (as a random-weight model under the
    constraint writes them): each is a call block the parser reads back as calls to the offered tools."""
    spec = forced_grammar(TOOLS, None, True)
    compiler = GrammarCompiler.for_tokenizer(tok, tok.vocab_size)
    closers = {t for t in range(tok.vocab_size) if tok.decode([t]) in ('"', "'", ")", "]", "}", CALL_END)}
    rng, read = random.Random(0), 0
    for _ in range(16):
        state, ids = compiler.start(spec), []
        while not state.finished and len(ids) < 400:
            allowed = [t for t in allowed_mask([state], tok.vocab_size)[0].nonzero().flatten().tolist()
                       if t not in tok.eot_ids]
            # a third of the time a token that closes something, where one is allowed: walks end sooner
            ids.append(rng.choice([t for t in allowed if t in closers] or allowed) if rng.random() < 0.3
                       else rng.choice(allowed))
            assert state.accept(ids[-1:])
        if not state.finished:
            continue  # still inside a long string: nothing to read
        text = tok.decode(ids)
        content, calls = parse_calls(text, _ctx(TOOLS))
        assert calls and content == "", ascii(text)
        assert all(isinstance(json.loads(call.arguments), dict) for call in calls)
        read += 1
    assert read >= 8, read


# --- calls in the history --------------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
ODD_ARGS = {"city": 'Paris "Left" Bank\n\u00e9', "days": 2, "metric": True, "alt": None, "opts": {"u": [1, False]}}
# LFM2.5-8B-A1B's template writes strings between single quotes as they are: no line break or ' in them
TEMPLATE_ARGS = {**ODD_ARGS, "city": 'Paris "Left" Bank \u00e9'}


@pytest.mark.parametrize("name", LFM)
def test_a_tool_conversation_renders_the_calls_the_model_made(name):
    """Each real template (two of which never render `tool_calls`) shows the earlier call once, in the models' own
    block, which reads back as the same call, then the tool's result."""
    from edgeserve.loaders.chat_template import ChatTemplate
    from edgeserve.server.api.openai import parse_chat_request
    from edgeserve.server.chat_setup import chat_setup

    call = {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": json.dumps(TEMPLATE_ARGS)}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    body = {"model": "m", "messages": messages, "tools": [WEATHER_TOOL]}
    prompt = chat_setup(parse_chat_request(body, 4), ChatTemplate(_template(name))).prompt
    turn = prompt.split("<|im_start|>assistant\n")[1]
    assert turn.count(CALL_START) == 1 and turn.startswith(CALL_START), turn
    rest, calls = parse_calls(turn[:turn.index("<|im_end|>")], _ctx([WEATHER_TOOL]))
    assert rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", TEMPLATE_ARGS)]
    assert "18 C" in prompt.split("<|im_start|>tool\n")[1] and prompt.endswith("<|im_start|>assistant\n")


def test_history_calls_follow_the_content_and_read_back():
    from edgeserve.text.formats.lfm2 import write_calls

    calls = [{"function": {"name": "a.b", "arguments": ODD_ARGS}}, {"function": {"name": "c", "arguments": {}}}]
    text = write_calls(calls)
    assert text.startswith(CALL_START + '[a.b(city="Paris \\"Left\\" Bank\\n\u00e9", days=2, metric=True, alt=None')
    _, read = parse_calls(text, CallContext({"a.b", "c"}, {}))
    assert [(c.name, json.loads(c.arguments)) for c in read] == [("a.b", ODD_ARGS), ("c", {})]

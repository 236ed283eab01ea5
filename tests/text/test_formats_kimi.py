"""Kimi K2 / K2-Thinking / K3 calls against llama.cpp's parser expectations and our own cases
(tests/data/chat_formats/kimi.json), their detection among llama.cpp's 70 templates, and their forced grammars."""

from __future__ import annotations

import json

import pytest

from edgeserve.text.formats import get_format
from edgeserve.text.formats.kimi import (ARGS_BEGIN, CALL_BEGIN, CALL_END, CLOSE, K2_TOKENS, K3_TOKENS, MESSAGE_END,
                                         OPEN, RESPONSE, SECTION_BEGIN, SECTION_END, SEP, TOOLS)
from format_family_check import check_forced_calls, context, family_tests, tools, vocab


test_reads_what_llama_cpp_reads, test_detected_for_its_templates_and_no_other = family_tests("kimi", {
    "kimi_k2": ["Kimi-K2-Instruct.jinja", "Kimi-K2-Thinking.jinja", "moonshotai-Kimi-K2.jinja"],
    "kimi_k3": ["Kimi-K3.jinja"],
})


@pytest.fixture(scope="module", params=["markup is special tokens", "markup is text"])
def tok(tmp_path_factory, request):
    special = request.param == "markup is special tokens"
    return vocab(tmp_path_factory.mktemp("kimi"), K2_TOKENS + K3_TOKENS if special else ())


def _k2(*calls):
    body = "".join(f"{CALL_BEGIN}functions.{n}:{i}{ARGS_BEGIN}{json.dumps(a)}{CALL_END}"
                   for i, (n, a) in enumerate(calls))
    return f"{SECTION_BEGIN}{body}{SECTION_END}"


def _k3(*calls):
    def arg(k, v):
        kind = "string" if isinstance(v, str) else "number"
        value = v if isinstance(v, str) else json.dumps(v)
        return f'{OPEN}argument key="{k}" type="{kind}"{SEP}{value}{CLOSE}argument{SEP}'
    body = "".join(f'{OPEN}call tool="{n}" index="{i + 1}"{SEP}' + "".join(arg(k, v) for k, v in a.items())
                   + f"{CLOSE}call{SEP}" for i, (n, a) in enumerate(calls))
    return f"Let me call.{CLOSE}think{SEP}{TOOLS[0]}{body}{TOOLS[1]}{MESSAGE_END}"


@pytest.mark.parametrize("name, build", [("kimi_k2", _k2), ("kimi_k3", _k3)])
def test_forced_grammar_admits_calls_that_parse_back_and_refuses_junk(tok, name, build):
    fmt = get_format(name)
    offered = tools("get_time_tool", "magic_int_tool")
    one = build(("get_time", {"city": "Paris </b>"}))
    two = build(("magic_int", {"ref": 42, "name": "foo bar"}), ("get_time", {"city": "New York"}))
    chatty = (one.replace(f"{CLOSE}think{SEP}", f"{CLOSE}think{SEP}{RESPONSE[0]}Sure.{RESPONSE[1]}")
              if name == "kimi_k3" else "Sure. " + one)  # an answer before the call
    check_forced_calls(tok, fmt, offered, [(one, [{"city": "Paris </b>"}]),
                                           (two, [{"ref": 42, "name": "foo bar"}, {"city": "New York"}])],
                       [chatty, build(("get_time", {"town": "Paris"})), build(("nope", {})),
                        build(("magic_int", {"ref": "three"})), build(("magic_int", {"name": "no ref"}))],
                       build(("magic_int", {"ref": 7})),
                       parsed=lambda reply: reply.split(f"{CLOSE}think{SEP}")[-1])  # after the thought


def test_k2_call_ids_are_the_models():
    text = _k2(("get_time", {"city": "Oslo"}), ("get_time", {"city": "Rome"}))
    _, calls = get_format("kimi_k2").parse(text, context(tools("get_time_tool")))
    assert [c.id for c in calls] == ["functions.get_time:0", "functions.get_time:1"]

"""MiniMax M1 / M2 / M3 calls against llama.cpp's parser expectations and our own cases
(tests/data/chat_formats/minimax.json), their detection among llama.cpp's 70 templates, and their forced
grammars."""

from __future__ import annotations

import json

import pytest

from edgeserve.text.formats import get_format
from edgeserve.text.formats.minimax import M2_TOKENS, M3_TOKENS, NS
from format_family_check import check_forced_calls, family_tests, tools, vocab


test_reads_what_llama_cpp_reads, test_detected_for_its_templates_and_no_other = family_tests("minimax", {
    "minimax_m1": ["MiniMax-M1.jinja"], "minimax_m2": ["MiniMax-M2.jinja"], "minimax_m3": ["MiniMax-M3.jinja"],
})


@pytest.fixture(scope="module", params=["markup is special tokens", "markup is text"])
def tok(tmp_path_factory, request):
    special = request.param == "markup is special tokens"
    return vocab(tmp_path_factory.mktemp("mm"), M2_TOKENS + M3_TOKENS if special else ())


def _m1(*calls):
    return "<tool_calls>\n" + "\n".join(json.dumps({"name": n, "arguments": a}) for n, a in calls) + "\n</tool_calls>"


def _m2(*calls):
    def param(k, v):
        return f'<parameter name="{k}">{v if isinstance(v, str) else json.dumps(v)}</parameter>\n'
    return "<minimax:tool_call>\n" + "".join(
        f'<invoke name="{n}">\n' + "".join(param(k, v) for k, v in a.items()) + "</invoke>\n" for n, a in calls
    ) + "</minimax:tool_call>"


def _m3(*calls):
    def el(k, v):
        return f"{NS}<{k}>{v if isinstance(v, str) else json.dumps(v)}{NS}</{k}>"
    return f"{NS}<tool_call>\n" + "".join(
        f'{NS}<invoke name="{n}">' + "".join(el(k, v) for k, v in a.items()) + f"{NS}</invoke>\n" for n, a in calls
    ) + f"{NS}</tool_call>"


@pytest.mark.parametrize("name, build", [("minimax_m1", _m1), ("minimax_m2", _m2), ("minimax_m3", _m3)])
def test_forced_grammar_admits_calls_that_parse_back_and_refuses_junk(tok, name, build):
    fmt = get_format(name)
    offered = tools("get_time_tool", "magic_int_tool", "imaginary_number_tool")
    one = build(("get_time", {"city": "Paris </b>"}))
    number = {"real": 1.5, "imaginary": -2}
    two = build(("magic_int", {"ref": 42, "name": "foo bar"}), ("imaginary_number", {"number": number}))
    check_forced_calls(tok, fmt, offered, [(one, [{"city": "Paris </b>"}]),
                                           (two, [{"ref": 42, "name": "foo bar"}, {"number": number}])],
                       ["Sure. " + one, build(("get_time", {"town": "Paris"})), build(("nope", {})),
                        build(("magic_int", {"ref": "three"})), build(("magic_int", {"name": "no ref"}))],
                       build(("magic_int", {"ref": 7})))

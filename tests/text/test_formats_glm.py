"""GLM-style `<arg_key>` / `<arg_value>` calls (GLM-4.6 / 4.7, Spark 2.5, Ling 3.0, Laguna) against llama.cpp's
parser expectations and our own cases (tests/data/chat_formats/glm.json), their detection among llama.cpp's 70
templates, and their forced grammars."""

from __future__ import annotations

import json

import pytest

from edgeserve.text.formats import get_format
from edgeserve.text.formats.glm import TOKENS
from format_family_check import check_forced_calls, context, family_tests, tools, vocab


test_reads_what_llama_cpp_reads, test_detected_for_its_templates_and_no_other = family_tests("glm", {
    "glm_4_6": ["GLM-4.6.jinja"],
    "glm_4_7": ["GLM-4.7-Flash.jinja", "Spark2.5.jinja"],
    "ling3": ["inclusionai-ling-3.0-flash.jinja"],
    "laguna": ["poolside-Laguna-S-2.1.jinja", "poolside-Laguna-XS-2.1.jinja", "poolside-Laguna-XS.2.jinja"],
})


def test_hermes_json_in_tool_call_tags_is_not_a_glm_call():
    text = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert get_format("glm_4_7").parse(text, context(tools("get_time_tool"))) == (text, [])


@pytest.fixture(scope="module", params=["tags are special tokens", "tags are text"])
def tok(tmp_path_factory, request):
    return vocab(tmp_path_factory.mktemp("glm"), TOKENS if request.param == "tags are special tokens" else ())


def _call(newline: bool, name: str, args: dict) -> str:
    nl = "\n" if newline else ""
    pairs = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>{nl}"
                    for k, v in args.items())
    return f"<tool_call>{name}{nl}{pairs}</tool_call>"


@pytest.mark.parametrize("name, newline", [("glm_4_6", True), ("glm_4_7", False), ("ling3", True), ("laguna", False)])
def test_forced_grammar_admits_calls_that_parse_back_and_refuses_junk(tok, name, newline):
    fmt = get_format(name)
    offered = tools("get_time_tool", "magic_int_tool")
    one = _call(newline, "get_time", {"city": "Paris </b> <i>"})
    two = _call(newline, "magic_int", {"ref": 42, "name": "foo bar"}) + ("\n" if newline else "") + \
        _call(newline, "get_time", {"city": "New York"})
    check_forced_calls(tok, fmt, offered, [(one, [{"city": "Paris </b> <i>"}]),
                                           (two, [{"ref": 42, "name": "foo bar"}, {"city": "New York"}])],
                       ["Sure. " + one, _call(newline, "get_time", {"town": "Paris"}), _call(newline, "nope", {}),
                        _call(newline, "magic_int", {"ref": "three"}), _call(newline, "magic_int", {"name": "no ref"}),
                        _call(not newline, "get_time", {"city": "Paris"}),
                        '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'],
                       _call(newline, "magic_int", {"ref": 7}))

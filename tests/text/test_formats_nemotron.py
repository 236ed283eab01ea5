"""Nemotron Nano v2's `<TOOLCALL>[...]</TOOLCALL>` calls against llama.cpp's parser expectations and our own cases
(tests/data/chat_formats/nemotron.json), detection among llama.cpp's 70 templates, and the forced grammar."""

from __future__ import annotations

import json

import pytest

from edgeserve.text.formats import get_format
from format_family_check import check_forced_calls, family_tests, tools, vocab


test_reads_what_llama_cpp_reads, test_detected_for_its_template_and_no_other = family_tests(
    "nemotron", {"nemotron_v2": ["NVIDIA-Nemotron-Nano-v2.jinja"]})


def _call(*calls):
    return "<TOOLCALL>" + json.dumps([{"name": n, "arguments": a} for n, a in calls]) + "</TOOLCALL>"


@pytest.mark.parametrize("specials", [("<TOOLCALL>", "</TOOLCALL>"), ()],
                         ids=["tags are special tokens", "tags are text"])
def test_forced_grammar_admits_calls_that_parse_back_and_refuses_junk(tmp_path, specials):
    tok = vocab(tmp_path, specials)
    fmt = get_format("nemotron_v2")
    offered = tools("get_time_tool", "magic_int_tool")
    one = _call(("get_time", {"city": "Paris"}))
    two = _call(("magic_int", {"ref": 42, "name": "foo bar"}), ("get_time", {"city": "New York"}))
    check_forced_calls(tok, fmt, offered, [(one, [{"city": "Paris"}]),
                                           (two, [{"ref": 42, "name": "foo bar"}, {"city": "New York"}])],
                       ["Sure. " + one, _call(("get_time", {"town": "Paris"})), _call(("nope", {})),
                        _call(("magic_int", {"ref": "three"})), "<TOOLCALL>[]</TOOLCALL>"],
                       _call(("magic_int", {"ref": 7})))


@pytest.mark.parametrize("name, text", [
    ("nemotron_v2", '<TOOLCALL>[{"name": "f", "arguments": "{\\"x\\": "}]</TOOLCALL>'),
    ("minimax_m1", '<tool_calls>\n{"name": "f", "arguments": "{\\"x\\": "}\n</tool_calls>'),
], ids=["nemotron_v2", "minimax_m1"])
def test_arguments_of_broken_json_text_leave_the_block_as_content(name, text):
    """A call whose arguments are JSON text that does not parse is no call: the block comes back as content, whole
    (it used to raise JSONDecodeError out of the parser)."""
    from edgeserve.text.formats.base import CallContext
    content, calls = get_format(name).parse(text, CallContext({"f"}))
    assert calls == [] and text in content

"""muse-glimmer's messages (` to=self` thoughts, ` to=user` answers, ` to=FUNCTION` calls) against llama.cpp's
parser expectations and our own cases (tests/data/chat_formats/muse_glimmer.json), detection among llama.cpp's 70
templates, and the forced grammar."""

from __future__ import annotations

import json

import pytest

from edgeserve.text.formats import get_format
from edgeserve.text.formats.muse_glimmer import TOKENS
from format_family_check import accepts, check_forced_calls, family_tests, tools, vocab


test_reads_what_llama_cpp_reads, test_detected_for_its_template_and_no_other = family_tests(
    "muse_glimmer", {"muse_glimmer": ["muse-glimmer.jinja"]})


def _call(name, args):
    params = "".join(f'<atem:parameter name="{k}">{v if isinstance(v, str) else json.dumps(v)}</atem:parameter>\n'
                     for k, v in args.items())
    return (f' to={name}<|message|><atem:function_calls>\n<atem:invoke name="{name}">\n{params}</atem:invoke>\n'
            "</atem:function_calls>")


@pytest.mark.parametrize("specials", [TOKENS, ()], ids=["markers are special tokens", "markers are text"])
def test_forced_grammar_admits_calls_that_parse_back_and_refuses_junk(tmp_path, specials):
    tok = vocab(tmp_path, specials)
    fmt = get_format("muse_glimmer")
    offered = tools("get_time_tool", "magic_int_tool")
    one = _call("get_time", {"city": "Paris </b>"})
    two = (_call("magic_int", {"ref": 42, "name": "foo bar"}) + "<|eom|><|start|>assistant"
           + _call("get_time", {"city": "Rome"}))
    spec = check_forced_calls(tok, fmt, offered, [(one, [{"city": "Paris </b>"}]),
                                                  (two, [{"ref": 42, "name": "foo bar"}, {"city": "Rome"}])],
                              [" to=user<|message|>Sure.", _call("get_time", {"town": "Paris"}), _call("nope", {}),
                               _call("magic_int", {"ref": "three"}), _call("magic_int", {"name": "no ref"})],
                              _call("magic_int", {"ref": 7}))
    assert accepts(tok, spec, " to=self<|message|>Let me see.<|eom|><|start|>assistant" + one)  # after a thought

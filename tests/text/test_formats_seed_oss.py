"""Seed-OSS calls and `<seed:think>` thoughts against llama.cpp's parser expectations and our own cases
(tests/data/chat_formats/seed_oss.json), detection among llama.cpp's 70 templates, and the forced grammar."""

from __future__ import annotations

import json

import pytest

from edgeserve.text.formats import get_format
from edgeserve.text.formats.seed_oss import TOKENS
from format_family_check import check_forced_calls, family_tests, tools, vocab


test_reads_what_llama_cpp_reads, test_detected_for_its_template_and_no_other = family_tests(
    "seed_oss", {"seed_oss": ["ByteDance-Seed-OSS.jinja"]})


def _call(*calls):
    def param(k, v):
        return f"<parameter={k}>{v if isinstance(v, str) else json.dumps(v)}</parameter>\n"
    return "\n".join(f"<seed:tool_call>\n<function={n}>\n" + "".join(param(k, v) for k, v in a.items())
                     + "</function>\n</seed:tool_call>" for n, a in calls)


@pytest.mark.parametrize("specials", [TOKENS, ()], ids=["tags are special tokens", "tags are text"])
def test_forced_grammar_admits_calls_that_parse_back_and_refuses_junk(tmp_path, specials):
    tok = vocab(tmp_path, specials)
    fmt = get_format("seed_oss")
    offered = tools("get_time_tool", "magic_int_tool")
    one = _call(("get_time", {"city": "Paris\nFrance </b>"}))
    two = _call(("magic_int", {"ref": 42, "name": "foo bar"}), ("get_time", {"city": "New York"}))
    check_forced_calls(tok, fmt, offered, [(one, [{"city": "Paris\nFrance </b>"}]),
                                           (two, [{"ref": 42, "name": "foo bar"}, {"city": "New York"}])],
                       ["Sure. " + one, _call(("get_time", {"town": "Paris"})), _call(("nope", {})),
                        _call(("magic_int", {"ref": "three"})), _call(("magic_int", {"name": "no ref"}))],
                       _call(("magic_int", {"ref": 7})))

"""Swiss AI Apertus (`<|tools_prefix|>[{"NAME": {...}}]<|tools_suffix|>`): llama.cpp's expectations for its
template, detection, the forced grammar."""

from __future__ import annotations

import pytest

from edgeserve.text.formats.apertus import INNER, TOOLS, forced
from format_cases import (CALL, HELLO, PICK, SPECIAL, SPECIAL_OPT, accepts, check, detections, forced_calls_parse_back,
                          no_call_stays_text, vocabulary)

CASES = [
    # Apertus-8B-Instruct.jinja
    ('<|tools_prefix|>[{"special_function": {"arg1": 1}}]<|tools_suffix|>', [SPECIAL], ("", "", [CALL])),
    # our own
    (HELLO, [SPECIAL], (HELLO, "", [])),
    ("<|inner_prefix|>I'm\nthinking<|inner_suffix|>" + HELLO, [], (HELLO, "I'm\nthinking", [])),
    ('Sure.<|tools_prefix|>[{"special_function": {"arg1": 1}}, {"special_function_with_opt": {"arg1": 1, "arg2": 2}}]'
     "<|tools_suffix|>", [SPECIAL, SPECIAL_OPT], ("Sure.", "", [CALL, ("special_function_with_opt",
                                                                        {"arg1": 1, "arg2": 2})])),
]


@pytest.mark.parametrize("text, tools, expect", CASES)
def test_expectations(text, tools, expect):
    check("apertus", text, tools, False, expect)


test_what_is_no_call_stays_text = no_call_stays_text(
    "apertus", ['<|tools_prefix|>[{"nope": {}}]<|tools_suffix|>',
               '<|tools_prefix|>[{"special_function": {"arg1": 1}, "x": 2}]',
               '<|tools_prefix|>[{"special_function": '])


def test_detection_over_llama_cpp_templates():
    assert [n for n, f in detections().items() if f == "apertus"] == ["Apertus-8B-Instruct.jinja"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return vocabulary(tmp_path_factory.mktemp("apertus"), (*TOOLS, *INNER))


def test_forced_grammar_accepts_calls_and_refuses_junk(tok):
    one = '<|tools_prefix|>[{"special_function": {"arg1": 1}}]<|tools_suffix|>'
    two = '<|tools_prefix|>[{"special_function": {"arg1": 1}}, {"pick": {"color": "red", "on": true}}]<|tools_suffix|>'
    assert accepts(tok, forced([SPECIAL, PICK], None, True), one)
    assert accepts(tok, forced([SPECIAL, PICK], None, True), two)
    assert not accepts(tok, forced([SPECIAL, PICK], None, False), two)
    assert not accepts(tok, forced([SPECIAL, PICK], "pick", True), one)
    assert not accepts(tok, forced([SPECIAL, PICK], None, True), one.replace("1}", '"1"}'))


@pytest.mark.parametrize("seed", range(2))
def test_forced_calls_parse_back(tok, seed):
    forced_calls_parse_back(tok, forced, "apertus", seed)

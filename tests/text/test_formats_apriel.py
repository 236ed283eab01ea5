"""ServiceNow Apriel 1.5 / 1.6 (`<tool_calls>[...]</tool_calls>`, 1.6's `[BEGIN FINAL RESPONSE]` reasoning):
llama.cpp's expectations for their templates, detection, the forced grammar."""

from __future__ import annotations

import pytest

from edgeserve.text.formats.apriel import TOOL_CALLS, forced
from format_cases import (CALL, HELLO, PICK, SPECIAL, accepts, check, detections, forced_calls_parse_back,
                          no_call_stays_text, vocabulary)

THOUGHT = "I'm\nthinking"
CASES = [
    # unsloth-Apriel-1.5.jinja
    ("apriel15", HELLO, [], False, (HELLO, "", [])),
    ("apriel15", '<tool_calls>[{"name": "special_function", "arguments": {"arg1": 1}}]</tool_calls>', [SPECIAL],
     False, ("", "", [CALL])),
    # Apriel-1.6-15b-Thinker-fixed.jinja: the prompt opens the reasoning with "Here are my reasoning steps:\n";
    # llama.cpp returns that opener as part of the reasoning, we return what the model wrote
    ("apriel16", THOUGHT + "\n[BEGIN FINAL RESPONSE]\n" + HELLO, [], True, (HELLO, THOUGHT, [])),
    ("apriel16", THOUGHT + '\n[BEGIN FINAL RESPONSE]\n<tool_calls>[{"name": "special_function", "arguments": '
     '{"arg1": 1}}]</tool_calls>', [SPECIAL], True, ("", THOUGHT, [CALL])),
]


@pytest.mark.parametrize("name, text, tools, opened, expect", CASES)
def test_expectations(name, text, tools, opened, expect):
    check(name, text, tools, opened, expect)


test_what_is_no_call_stays_text = no_call_stays_text(
    "apriel15", ['<tool_calls>[{"name": "nope", "arguments": {}}]</tool_calls>',
                '<tool_calls>{"name": "special_function", "arguments": {"arg1": 1}}</tool_calls>',
                "<tool_calls>[{"])


def test_detection_over_llama_cpp_templates():
    found = detections()
    assert [n for n, f in found.items() if f == "apriel15"] == ["unsloth-Apriel-1.5.jinja"]
    assert [n for n, f in found.items() if f == "apriel16"] == ["Apriel-1.6-15b-Thinker-fixed.jinja"]
    assert found["MiniMax-M1.jinja"] not in ("apriel15", "apriel16")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return vocabulary(tmp_path_factory.mktemp("apriel"), TOOL_CALLS)


def test_forced_grammar_accepts_calls_and_refuses_junk(tok):
    one = '<tool_calls>[{"name": "special_function", "arguments": {"arg1": 1}}]</tool_calls>'
    assert accepts(tok, forced([SPECIAL, PICK], None, True), one)
    assert not accepts(tok, forced([SPECIAL, PICK], "pick", True), one)
    assert not accepts(tok, forced([SPECIAL, PICK], None, True), one.replace("]<", "<"))


@pytest.mark.parametrize("seed", range(2))
def test_forced_calls_parse_back(tok, seed):
    forced_calls_parse_back(tok, forced, "apriel16", seed)

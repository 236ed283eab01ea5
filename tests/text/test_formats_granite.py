"""IBM Granite 3.3 (`<|tool_call|>[...]`, `<think>` / `<response>`): llama.cpp's expectations for its template,
detection (Granite 4.0 / 4.1 stay hermes), the forced grammar."""

from __future__ import annotations

import pytest

from edgeserve.text.formats.granite import forced
from format_cases import (CALL, HELLO, PICK, SPECIAL, SPECIAL_OPT, accepts, check, detections, forced_calls_parse_back,
                          no_call_stays_text, vocabulary)

CASES = [
    # ibm-granite-granite-3.3-2B-Instruct.jinja
    (HELLO, [], (HELLO, "", [])),
    ("<think>I'm\nthinking</think>" + HELLO, [], (HELLO, "I'm\nthinking", [])),
    # llama.cpp leaves this one pending (a TODO in test-chat.cpp); the <response> wrapper is dropped here
    ("<think>I'm\nthinking</think><response>" + HELLO + "</response>", [], (HELLO, "I'm\nthinking", [])),
    # our own: the template's documented call syntax
    ('<|tool_call|>[{"name": "special_function", "arguments": {"arg1": 1}}]', [SPECIAL], ("", "", [CALL])),
    ('Let me check.<|tool_call|>[{"name": "special_function", "arguments": {"arg1": 1}}, '
     '{"name": "special_function_with_opt", "arguments": {"arg1": 1, "arg2": 2}}]', [SPECIAL, SPECIAL_OPT],
     ("Let me check.", "", [CALL, ("special_function_with_opt", {"arg1": 1, "arg2": 2})])),
]


@pytest.mark.parametrize("text, tools, expect", CASES)
def test_expectations(text, tools, expect):
    check("granite", text, tools, False, expect)


test_what_is_no_call_stays_text = no_call_stays_text(
    "granite", ['<|tool_call|>[{"name": "nope", "arguments": {}}]', "<|tool_call|>[{\"name\": ",
               "<|tool_call|> maybe later"])


def test_detection_over_llama_cpp_templates():
    found = detections()
    assert [n for n, f in found.items() if f == "granite"] == ["ibm-granite-granite-3.3-2B-Instruct.jinja"]
    assert found["ibm-granite-granite-4.0.jinja"] == found["ibm-granite-granite-4.1.jinja"] == "hermes"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return vocabulary(tmp_path_factory.mktemp("granite"), ("<|tool_call|>",))


def test_forced_grammar_accepts_calls_and_refuses_junk(tok):
    one = '<|tool_call|>[{"name": "special_function", "arguments": {"arg1": 1}}]'
    assert accepts(tok, forced([SPECIAL, PICK], None, True), one)
    assert accepts(tok, forced([SPECIAL, PICK], None, True), one[:-1] + ', ' + one[14:])
    assert not accepts(tok, forced([SPECIAL, PICK], None, False), one[:-1] + ', ' + one[14:])
    assert not accepts(tok, forced([SPECIAL, PICK], "pick", True), one)
    assert not accepts(tok, forced([SPECIAL, PICK], None, True), "Sure " + one)


@pytest.mark.parametrize("seed", range(2))
def test_forced_calls_parse_back(tok, seed):
    forced_calls_parse_back(tok, forced, "granite", seed)

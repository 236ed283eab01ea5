"""GigaChat 3 (a `function call` role message) and 3.1 (`<|function_call|>{...}`): llama.cpp's expectations for
their templates, detection, the forced grammars."""

from __future__ import annotations

import pytest

from edgeserve.text.formats.gigachat import TOKENS, FORMATS
from format_cases import (CALL, HELLO, PICK, SPECIAL, accepts, check, context, detections, no_call_stays_text,
                          random_reply, vocabulary)

V3_CALL = '<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "special_function", "arguments": {"arg1": 1}}'
V31_CALL = '<|function_call|>{"name": "special_function", "arguments": {"arg1": 1}}'
CASES = [
    # GigaChat3-10B-A1.8B.jinja
    ("gigachat3", HELLO, [], (HELLO, "", [])),
    ("gigachat3", V3_CALL, [SPECIAL], ("", "", [CALL])),
    ("gigachat3", HELLO + V3_CALL, [SPECIAL], (HELLO, "", [CALL])),
    # GigaChat3.1-10B-A1.8B.jinja
    ("gigachat31", HELLO, [], (HELLO, "", [])),
    ("gigachat31", V31_CALL, [SPECIAL], ("", "", [CALL])),
    ("gigachat31", HELLO + V31_CALL, [SPECIAL], (HELLO, "", [CALL])),
]


@pytest.mark.parametrize("name, text, tools, expect", CASES)
def test_expectations(name, text, tools, expect):
    check(name, text, tools, False, expect)


test_what_is_no_call_stays_text = no_call_stays_text(
    "gigachat31", [V31_CALL.replace("special_function", "nope"), '<|function_call|>[{"name": 1}]',
                  V31_CALL[:-3]])


def test_detection_over_llama_cpp_templates():
    found = detections()
    assert [n for n, f in found.items() if f == "gigachat3"] == ["GigaChat3-10B-A1.8B.jinja"]
    assert [n for n, f in found.items() if f == "gigachat31"] == ["GigaChat3.1-10B-A1.8B.jinja"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return vocabulary(tmp_path_factory.mktemp("gigachat"), TOKENS)


@pytest.mark.parametrize("fmt, call", zip(FORMATS, (V3_CALL, V31_CALL)))
def test_forced_grammar_accepts_one_call_and_refuses_junk(tok, fmt, call):
    assert accepts(tok, fmt.forced([SPECIAL, PICK], None, True), call)
    assert not accepts(tok, fmt.forced([SPECIAL, PICK], None, True), call + call)  # one call per reply
    assert not accepts(tok, fmt.forced([SPECIAL, PICK], "pick", True), call)
    assert not accepts(tok, fmt.forced([SPECIAL, PICK], None, True), HELLO)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seed", range(2))
def test_forced_calls_parse_back(tok, fmt, seed):
    reply = random_reply(tok, fmt.forced([PICK], None, True), seed)
    content, calls = fmt.parse(reply, context([PICK]))
    assert content == "" and len(calls) == 1, reply

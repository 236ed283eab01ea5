"""Upstage Solar Open (`<|tool_calls|><|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{...}`):
llama.cpp has no parser expectations for its template, so the cases are the template's own rendering of calls,
read back; detection; the forced grammar."""

from __future__ import annotations

import pytest

from edgeserve.loaders.chat_template import ChatTemplate
from edgeserve.text.formats import get_format
from edgeserve.text.formats.solar_open import TOKENS, forced
from format_cases import (GET_TIME, HELLO, SPECIAL, accepts, check, context, detections, forced_calls_parse_back,
                          templates, vocabulary)

CALLS = [("special_function", {"arg1": 1}, "a1b2c3d4e5"), ("get_time", {"city": "Paris"}, "0123456789")]


def _rendered(calls: list[tuple[str, dict, str]]) -> str:
    """What the template writes for an assistant turn with these calls, after its `<|begin|>assistant`."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for n, a, i in calls]}]
    out = ChatTemplate(templates()["upstage-Solar-Open-100B.jinja"]).render(messages, add_generation_prompt=False,
                                                                              tools=[SPECIAL, GET_TIME])
    return out[out.rindex("<|begin|>assistant") + len("<|begin|>assistant"):]


@pytest.mark.parametrize("calls", [CALLS[:1], CALLS])
def test_the_templates_own_calls_read_back(calls):
    check("solar_open", _rendered(calls), [SPECIAL, GET_TIME], False, ("", "", calls))


def test_content_and_reasoning():
    check("solar_open", "<|content|>" + HELLO + "<|end|>", [], False, (HELLO, "", []))
    check("solar_open", "<|think|>I'm\nthinking<|end|><|begin|>assistant<|content|>" + HELLO, [], False,
          (HELLO, "I'm\nthinking", []))


def test_what_is_no_call_stays_text():
    text = "<|tool_calls|><|tool_call:begin|>x<|tool_call:name|>nope<|tool_call:args|>{}<|tool_call:end|><|calls|>"
    assert get_format("solar_open").parse(text, context([SPECIAL])) == (text, [])


def test_detection_over_llama_cpp_templates():
    assert [n for n, f in detections().items() if f == "solar_open"] == ["upstage-Solar-Open-100B.jinja"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return vocabulary(tmp_path_factory.mktemp("solar"), TOKENS)


def test_forced_grammar_accepts_calls_and_refuses_junk(tok):
    assert accepts(tok, forced([SPECIAL, GET_TIME], None, True), _rendered(CALLS))
    assert not accepts(tok, forced([SPECIAL, GET_TIME], None, False), _rendered(CALLS))
    assert not accepts(tok, forced([SPECIAL, GET_TIME], "get_time", True), _rendered(CALLS[:1]))
    assert not accepts(tok, forced([SPECIAL, GET_TIME], None, True), "<|content|>" + HELLO)


@pytest.mark.parametrize("seed", range(2))
def test_forced_calls_parse_back(tok, seed):
    forced_calls_parse_back(tok, forced, "solar_open", seed)

"""Tencent Hunyuan 3 (`<tool_calls:opensource>` blocks of arg_key / arg_value pairs): llama.cpp has no parser
expectations for tencent-Hy3.jinja, so the cases are the template's own rendering of calls, read back; detection;
the forced grammar."""

from __future__ import annotations

import pytest

from edgeserve.loaders.chat_template import ChatTemplate
from edgeserve.text.formats.hunyuan import TOKENS, forced
from format_cases import (GET_TIME, HELLO, SPECIAL, TODO_LIST, accepts, check, detections, forced_calls_parse_back,
                          no_call_stays_text, templates, vocabulary)

ASSISTANT = "<｜hy_Assistant:opensource｜>"
CALLS = [("special_function", {"arg1": 1}), ("get_time", {"city": "Paris"}), ("todo_list", {"todos": ["a", "b"]})]


def _rendered(calls: list[tuple[str, dict]], reasoning: str) -> str:
    """What the template writes for an assistant turn with these calls (the model's own syntax)."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "reasoning_content": reasoning,
                 "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                                for i, (n, a) in enumerate(calls)]}]
    out = ChatTemplate(templates()["tencent-Hy3.jinja"]).render(messages, add_generation_prompt=False,
                                                                  tools=[SPECIAL, GET_TIME, TODO_LIST])
    return out[out.rindex(ASSISTANT) + len(ASSISTANT):].removesuffix("<｜hy_eos:opensource｜>")


@pytest.mark.parametrize("calls", [CALLS[:1], CALLS])
def test_the_templates_own_calls_read_back(calls):
    check("hunyuan3", _rendered(calls, "I'm\nthinking"), [SPECIAL, GET_TIME, TODO_LIST], False,
          ("", "I'm\nthinking", calls))


def test_content_and_reasoning():
    check("hunyuan3", "<think:opensource>I'm\nthinking</think:opensource>" + HELLO, [], False,
          (HELLO, "I'm\nthinking", []))
    check("hunyuan3", "</think:opensource>" + HELLO, [], True, (HELLO, "", []))  # the prompt opened the thought


test_what_is_no_call_stays_text = no_call_stays_text("hunyuan3", [
    "<tool_calls:opensource>\n<tool_call:opensource>nope<tool_sep:opensource>\n</tool_call:opensource>",
    "<tool_calls:opensource>\n<tool_call:opensource>special_function<tool_sep:opensource>\n"
    "<arg_key:opensource>arg1</arg_key:opensource>\n<arg_value:opensource>1",
])


def test_detection_over_llama_cpp_templates():
    assert [n for n, f in detections().items() if f == "hunyuan3"] == ["tencent-Hy3.jinja"]


@pytest.fixture(scope="module", params=["tags are tokens", "tags are text"])
def tok(tmp_path_factory, request):
    return vocabulary(tmp_path_factory.mktemp("hy3"), TOKENS if request.param == "tags are tokens" else ())


def test_forced_grammar_accepts_calls_and_refuses_junk(tok):
    spec = forced([SPECIAL, GET_TIME], None, True)
    assert accepts(tok, spec, _rendered(CALLS[:2], "")[len("<think:opensource></think:opensource>"):])
    assert not accepts(tok, forced([SPECIAL, GET_TIME], None, False),
                       _rendered(CALLS[:2], "")[len("<think:opensource></think:opensource>"):])
    assert not accepts(tok, spec, _rendered([("special_function", {"arg1": "x"})], "")[37:])
    assert not accepts(tok, spec, HELLO)


@pytest.mark.parametrize("seed", range(2))
def test_forced_calls_parse_back(tok, seed):
    forced_calls_parse_back(tok, forced, "hunyuan3", seed)

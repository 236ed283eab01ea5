"""Mistral Small 3.2 / Devstral / Ministral 3 / Magistral calls (`[TOOL_CALLS]NAME[ARGS]{...}`): llama.cpp's
expectations for their templates, detection, and the forced-call grammar."""

from __future__ import annotations

import pytest

from edgeserve.text.formats import CallContext, get_format
from edgeserve.text.formats.mistral3 import TOKENS, forced
from format_cases import (GET_TIME, PICK, SPECIAL, SPECIAL_OPT, accepts, assert_detected_exactly, context,
                          no_call_stays_text, random_reply, split, vocabulary)

HELLO = "Hello, world!\nWhat's up?"
CALL = ("special_function", {"arg1": 1})

# (template's format, reply, tools, prompt opened the thought, (content, reasoning, [(name, args[, id])]))
CASES = [
    # mistralai-Ministral-3-14B-Reasoning-2512.jinja
    ("magistral", HELLO, [], False, (HELLO, "", [])),
    ("magistral", "[THINK]I'm\nthinking[/THINK]" + HELLO, [], False, (HELLO, "I'm\nthinking", [])),
    ("magistral", '[TOOL_CALLS]special_function[ARGS]{"arg1":1}', [SPECIAL], False, ("", "", [CALL])),
    ("magistral", "[THINK]I'm\nthinking[/THINK]" '[TOOL_CALLS]special_function[ARGS]{"arg1":1}', [SPECIAL], False,
     ("", "I'm\nthinking", [CALL])),
    ("magistral", '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}'
                  '[TOOL_CALLS]special_function_with_opt[ARGS]{"arg1": 1, "arg2": 2}', [SPECIAL, SPECIAL_OPT], False,
     ("", "", [CALL, ("special_function_with_opt", {"arg1": 1, "arg2": 2})])),
    ("magistral", "[THINK]Let me think about [TOOL_CALLS]special_function[ARGS]{\"arg1\":1} and more[/THINK]"
                  '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}', [SPECIAL], False,
     ("", "Let me think about [TOOL_CALLS]special_function[ARGS]{\"arg1\":1} and more", [CALL])),
    # Mistral-Small-3.2-24B-Instruct-2506.jinja
    ("mistral3", HELLO, [], False, (HELLO, "", [])),
    ("mistral3", '[TOOL_CALLS]special_function[CALL_ID]123456789[ARGS]{"arg1": 1}', [SPECIAL], False,
     ("", "", [(*CALL, "123456789")])),
    ("mistral3", '[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]{"arg1": 1}'
                 '[TOOL_CALLS]special_function_with_opt[CALL_ID]000000002[ARGS]{"arg1": 1, "arg2": 2}',
     [SPECIAL, SPECIAL_OPT], False,
     ("", "", [(*CALL, "000000001"), ("special_function_with_opt", {"arg1": 1, "arg2": 2}, "000000002")])),
    # unsloth-mistral-Devstral-Small-2507.jinja
    ("mistral3", '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}', [SPECIAL], False, ("", "", [CALL])),
    ("mistral3", HELLO + '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}', [SPECIAL], False, (HELLO, "", [CALL])),
]


@pytest.mark.parametrize("name, text, tools, opened, expect", CASES)
def test_llama_cpp_expectations(name, text, tools, opened, expect):
    content, reasoning, calls = split(get_format(name), text, tools, opened)
    assert (content, reasoning) == expect[:2]
    assert [c[:2] for c in calls] == [c[:2] for c in expect[2]]
    for got, want in zip(calls, expect[2]):
        if len(want) == 3:  # [CALL_ID]'s id; a call without one gets a 9-character id the template accepts
            assert got[2] == want[2]
        else:
            assert len(got[2]) == 9 and got[2].isalnum()


test_what_is_no_call_stays_text = no_call_stays_text("mistral3", [
    '[TOOL_CALLS]nope[ARGS]{"arg1": 1}',  # unknown function
    '[TOOL_CALLS]special_function[ARGS]{"arg1": ',  # cut short
    "[TOOL_CALLS]special_function[ARGS]not json",
    "[TOOL_CALLS] is how I would call a tool",
])


def test_text_between_and_after_calls_is_kept_and_old_json_lists_read():
    text = '[TOOL_CALLS]special_function[ARGS]{"arg1": 1} note [TOOL_CALLS]get_time[ARGS]{"city": "Paris"} end'
    content, calls = get_format("mistral3").parse(text, context([SPECIAL, GET_TIME]))
    assert content == "note  end" and [c.name for c in calls] == ["special_function", "get_time"]
    nemo = '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]'
    content, calls = get_format("mistral3").parse(nemo, context([SPECIAL]))
    assert content == "" and (calls[0].name, calls[0].arguments, calls[0].id) == (*CALL[:1], '{"arg1": 1}',
                                                                                  "123456789")


def test_detection_over_llama_cpp_templates():
    assert_detected_exactly({"mistralai-Ministral-3-14B-Reasoning-2512.jinja": "magistral",
                             "Mistral-Small-3.2-24B-Instruct-2506.jinja": "mistral3",
                             "unsloth-mistral-Devstral-Small-2507.jinja": "mistral3"})  # not Nemo's JSON-list template


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return vocabulary(tmp_path_factory.mktemp("mistral3"), TOKENS)


def test_forced_grammar_accepts_calls_and_refuses_junk(tok):
    spec = forced([SPECIAL, PICK], None, True)
    call = '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}'
    assert accepts(tok, spec, call)
    assert accepts(tok, spec, call + '[TOOL_CALLS]pick[ARGS]{"color": "red", "on": true}')
    for junk in ("Sure! " + call, '[TOOL_CALLS]nope[ARGS]{"arg1": 1}',
                 '[TOOL_CALLS]special_function[ARGS]{"arg1": "x"}',
                 '[TOOL_CALLS]special_function{"arg1": 1}'):
        assert not accepts(tok, spec, junk), junk
    assert not accepts(tok, forced([SPECIAL, PICK], None, False), call + call)
    assert not accepts(tok, forced([SPECIAL, PICK], "pick", True), call)


@pytest.mark.parametrize("seed", range(4))
def test_forced_calls_parse_back(tok, seed):
    reply = random_reply(tok, forced([PICK], None, True), seed)
    content, calls = get_format("magistral").parse(reply, CallContext({"pick"}))
    assert content == "" and calls and all(c.name == "pick" for c in calls), reply

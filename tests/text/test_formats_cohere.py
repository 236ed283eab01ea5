"""Command R7B / Cohere2 MoE / Command R+ calls (a JSON list of `tool_name` / `parameters` objects after
`<|START_ACTION|>` or `Action:`): llama.cpp's expectations for their templates, detection, forced grammars."""

from __future__ import annotations

import pytest

from edgeserve.text.formats import get_format
from edgeserve.text.formats.cohere import TOKENS, forced_action, forced_plus
from format_cases import (CALL, HELLO, PICK, PYTHON, SPECIAL, TODO_LIST, accepts, assert_detected_exactly, check,
                          context, forced_calls_parse_back, vocabulary)

THOUGHT = "I'm\nthinking"
ACTION_ONE = ("<|START_ACTION|>[\n"
              "    {\"tool_call_id\": \"0\", \"tool_name\": \"special_function\", \"parameters\": {\"arg1\": 1}}\n"
              "]<|END_ACTION|>")

CASES = [
    # CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja
    ("command_r7b", "<|START_RESPONSE|>" + HELLO + "<|END_RESPONSE|>", [SPECIAL], False, (HELLO, "", [])),
    ("command_r7b", "<|START_THINKING|>" + THOUGHT + "<|END_THINKING|><|START_RESPONSE|>" + HELLO
     + "<|END_RESPONSE|>", [SPECIAL], False, (HELLO, THOUGHT, [])),
    ("command_r7b", "<|START_THINKING|>" + THOUGHT + "<|END_THINKING|>" + ACTION_ONE, [SPECIAL], False,
     ("", THOUGHT, [(*CALL, "0")])),
    ("command_r7b", "<|START_THINKING|><|END_THINKING|>" + ACTION_ONE, [SPECIAL], False, ("", "", [(*CALL, "0")])),
    # Cohere2MoE.jinja (the prompt opens the thought)
    ("cohere2moe", THOUGHT + "<|END_THINKING|><|START_TEXT|>" + HELLO + "<|END_TEXT|>", [], True, (HELLO, THOUGHT, [])),
    ("cohere2moe", "<|END_THINKING|><|START_TEXT|>" + HELLO + "<|END_TEXT|>", [], True, (HELLO, "", [])),
    ("cohere2moe", "I need to output the invoice details in JSON<|END_THINKING|>"
     "<|START_TEXT|>{\"amount\": 123.45, \"date\": \"2025-12-03\"}<|END_TEXT|>", [SPECIAL], True,
     ('{"amount": 123.45, "date": "2025-12-03"}', "I need to output the invoice details in JSON", [])),
    ("cohere2moe", THOUGHT + "<|END_THINKING|>" + ACTION_ONE, [SPECIAL], True, ("", THOUGHT, [(*CALL, "0")])),
    ("cohere2moe", "<|END_THINKING|>" + ACTION_ONE, [SPECIAL], True, ("", "", [(*CALL, "0")])),
    ("cohere2moe", "<|END_THINKING|><|START_ACTION|>[\n"
     "    {\"tool_call_id\": \"0\", \"tool_name\": \"todo_list\", "
     "\"parameters\": {\"todos\": [\"buy milk\", \"walk dog\"]}}\n"
     "]<|END_ACTION|>", [TODO_LIST], True, ("", "", [("todo_list", {"todos": ["buy milk", "walk dog"]}, "0")])),
    ("cohere2moe", THOUGHT + "<|END_THINKING|><|START_ACTION|>[\n"
     "    {\"tool_call_id\": \"0\", \"tool_name\": \"special_function\", \"parameters\": {\"arg1\": 1}},\n"
     "    {\"tool_call_id\": \"1\", \"tool_name\": \"python\", \"parameters\": {\"code\": \"print('hey')\"}}\n"
     "]<|END_ACTION|>", [SPECIAL, PYTHON], True,
     ("", THOUGHT, [(*CALL, "0"), ("python", {"code": "print('hey')"}, "1")])),
    ("cohere2moe", THOUGHT + "<|END_THINKING|><|START_TEXT|>" + HELLO + "<|END_TEXT|>", [SPECIAL], True,
     (HELLO, THOUGHT, [])),
    # CohereForAI-c4ai-command-r-plus-tool_use.jinja
    ("command_r_plus", "<|CHATBOT_TOKEN|>" + HELLO + "<|END_OF_TURN_TOKEN|>", [SPECIAL], False, (HELLO, "", [])),
    ("command_r_plus", "Action:\n```json\n[{\"tool_name\": \"special_function\", \"parameters\": {\"arg1\": 1}}]\n```",
     [SPECIAL], False, ("", "", [CALL])),
]


@pytest.mark.parametrize("name, text, tools, opened, expect", CASES)
def test_llama_cpp_expectations(name, text, tools, opened, expect):
    check(name, text, tools, opened, expect)


@pytest.mark.parametrize("name, text", [
    ("command_r7b", "<|START_ACTION|>[{\"tool_call_id\": \"0\", \"tool_name\": \"nope\", \"parameters\": {}}]"),
    ("command_r7b", "<|START_ACTION|>[{\"tool_call_id\": \"0\", \"tool_name\": \"special_function\", "),
    ("command_r_plus", "Action: I will answer directly."),
    ("command_r_plus", "Action:\n```json\n[{\"tool_name\": \"directly-answer\", \"parameters\": {}}]\n```"),
])
def test_what_is_no_call_stays_text(name, text):
    assert get_format(name).parse(text, context([SPECIAL])) == (text, [])


def test_detection_over_llama_cpp_templates():
    assert_detected_exactly({"CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": "command_r7b",
                             "Cohere2MoE.jinja": "cohere2moe",
                             "CohereForAI-c4ai-command-r-plus-tool_use.jinja": "command_r_plus"})


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return vocabulary(tmp_path_factory.mktemp("cohere"), TOKENS)


def test_forced_grammars_accept_calls_and_refuse_junk(tok):
    spec = forced_action([SPECIAL, PICK], None, True)
    assert accepts(tok, spec, ACTION_ONE)
    two = ACTION_ONE.replace("}}\n]", "}},\n    {\"tool_call_id\": \"1\", \"tool_name\": \"pick\", "
                                       "\"parameters\": {\"color\": \"red\", \"on\": true}}\n]")
    assert accepts(tok, spec, two)
    assert not accepts(tok, forced_action([SPECIAL, PICK], None, False), two)
    assert not accepts(tok, forced_action([SPECIAL, PICK], "pick", True), ACTION_ONE)
    for junk in ("Sure " + ACTION_ONE, ACTION_ONE.replace("special_function", "nope"),
                 ACTION_ONE.replace('{"arg1": 1}', '{"arg1": "one"}'), "<|START_RESPONSE|>hi<|END_RESPONSE|>"):
        assert not accepts(tok, spec, junk), junk
    plus = ("Action:\n```json\n[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"special_function\", "
            "\"parameters\": {\"arg1\": 1}}\n]```")
    assert accepts(tok, forced_plus([SPECIAL], None, True), plus)
    assert not accepts(tok, forced_plus([SPECIAL], None, True), "Action: none")


@pytest.mark.parametrize("name, grammar", [("command_r7b", forced_action), ("cohere2moe", forced_action),
                                           ("command_r_plus", forced_plus)])
@pytest.mark.parametrize("seed", range(2))
def test_forced_calls_parse_back(tok, name, grammar, seed):
    forced_calls_parse_back(tok, grammar, name, seed, [PICK, SPECIAL])

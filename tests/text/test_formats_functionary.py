"""functionary v3.1 (`<function=NAME>{...}</function>`, `<|python_tag|>`), v3.2 (`>>>NAME\\n{...}`) and
firefunction v2 (` functools[...]`): llama.cpp's expectations for their templates, detection, forced grammars."""

from __future__ import annotations

import pytest

from edgeserve.text.formats import get_format
from edgeserve.text.formats.functionary import forced_firefunction, forced_v31, forced_v32
from format_cases import (CALL, HELLO, PICK, PYTHON, SPECIAL, SPECIAL_OPT, accepts, assert_detected_exactly, check,
                          context, forced_calls_parse_back, vocabulary)

CASES = [
    # meetkai-functionary-medium-v3.1.jinja
    ("functionary_v31", HELLO, [], False, (HELLO, "", [])),
    ("functionary_v31", '<function=special_function>{"arg1": 1}</function>', [SPECIAL], False, ("", "", [CALL])),
    # meetkai-functionary-medium-v3.2.jinja (the prompt ends with ">>>")
    ("functionary_v32", "all\n" + HELLO, [], False, (HELLO, "", [])),
    ("functionary_v32", 'special_function\n{"arg1": 1}', [SPECIAL], False, ("", "", [CALL])),
    # fireworks-ai-llama-3-firefunction-v2.jinja
    ("firefunction_v2", HELLO, [], False, (HELLO, "", [])),
    ("firefunction_v2", ' functools[{"name": "special_function", "arguments": {"arg1": 1}}]', [SPECIAL], False,
     ("", "", [CALL])),
]

MORE = [  # our own
    ("functionary_v31", 'Let me see. <function=special_function>{"arg1": 1}</function>'
                        '<function=special_function_with_opt>{"arg1": 1, "arg2": 2}</function>', [SPECIAL, SPECIAL_OPT],
     False, ("Let me see. ", "", [CALL, ("special_function_with_opt", {"arg1": 1, "arg2": 2})])),
    ("functionary_v31", "<|python_tag|>print('hey')", [PYTHON], False,
     ("", "", [("python", {"code": "print('hey')"})])),
    ("functionary_v32", 'all\nChecking.>>>special_function\n{"arg1": 1}>>>python\nprint(1)', [SPECIAL, PYTHON],
     False, ("Checking.", "", [CALL, ("python", {"code": "print(1)"})])),
    ("functionary_v32", 'all\nUse >>>nope\n{} like this', [SPECIAL], False, ("Use >>>nope\n{} like this", "", [])),
    ("firefunction_v2", 'Sure. functools[{"name": "special_function", "arguments": {"arg1": 1}}, '
                        '{"name": "python", "arguments": {"code": "1"}}]', [SPECIAL, PYTHON], False,
     ("Sure.", "", [CALL, ("python", {"code": "1"})])),
]


@pytest.mark.parametrize("name, text, tools, opened, expect", CASES + MORE)
def test_expectations(name, text, tools, opened, expect):
    check(name, text, tools, opened, expect)


@pytest.mark.parametrize("name, text", [
    ("functionary_v31", '<function=nope>{"arg1": 1}</function>'),
    ("functionary_v31", '<function=special_function>{"arg1": '),
    ("functionary_v32", 'special_function\n{"arg1": 1} and more'),
    ("functionary_v32", "nope\n{}"),
    ("firefunction_v2", ' functools[{"name": "nope", "arguments": {}}]'),
    ("firefunction_v2", " functools are nice"),
])
def test_what_is_no_call_stays_text(name, text):
    assert get_format(name).parse(text, context([SPECIAL])) == (text, [])


def test_detection_over_llama_cpp_templates():
    assert_detected_exactly({"meetkai-functionary-medium-v3.1.jinja": "functionary_v31",
                             "meetkai-functionary-medium-v3.2.jinja": "functionary_v32",
                             "fireworks-ai-llama-3-firefunction-v2.jinja": "firefunction_v2"})


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return vocabulary(tmp_path_factory.mktemp("functionary"), ("<|python_tag|>",))


def test_forced_grammars_accept_calls_and_refuse_junk(tok):
    v31 = '<function=special_function>{"arg1": 1}</function>'
    assert accepts(tok, forced_v31([SPECIAL, PICK], None, True), v31 + v31)
    assert not accepts(tok, forced_v31([SPECIAL, PICK], None, False), v31 + v31)
    assert not accepts(tok, forced_v31([SPECIAL, PICK], "pick", True), v31)
    assert not accepts(tok, forced_v31([SPECIAL, PICK], None, True), "ok " + v31)
    v32 = 'special_function\n{"arg1": 1}'
    assert accepts(tok, forced_v32([SPECIAL, PICK], None, True), v32 + ">>>" + v32)
    assert not accepts(tok, forced_v32([SPECIAL, PICK], None, True), "all\nhi")
    fire = ' functools[{"name": "special_function", "arguments": {"arg1": 1}}]'
    assert accepts(tok, forced_firefunction([SPECIAL, PICK], None, True), fire)
    assert not accepts(tok, forced_firefunction([SPECIAL, PICK], None, True), fire.replace("1}", '"x"}'))


@pytest.mark.parametrize("name, grammar", [("functionary_v31", forced_v31), ("functionary_v32", forced_v32),
                                           ("firefunction_v2", forced_firefunction)])
@pytest.mark.parametrize("seed", range(2))
def test_forced_calls_parse_back(tok, name, grammar, seed):
    forced_calls_parse_back(tok, grammar, name, seed)

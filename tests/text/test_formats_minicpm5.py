"""OpenBMB MiniCPM5 (`<function name="..."><param name="...">...</param></function>`): llama.cpp's expectations
for its template, detection, the forced grammar."""

from __future__ import annotations

import pytest

from edgeserve.text.formats.minicpm5 import forced
from format_cases import (EMPTY_ARGS, HELLO, HTML, PICK, PYTHON, SPECIAL, accepts, check, detections,
                          forced_calls_parse_back, no_call_stays_text, vocabulary)

CASES = [
    # openbmb-MiniCPM5-1B.jinja
    (HELLO, [], False, (HELLO, "", [])),
    ('<function name="python"><param name="code">print(\'Hello, World!\')</param></function>', [PYTHON], False,
     ("", "", [("python", {"code": "print('Hello, World!')"})])),
    ('<function name="empty_args"></function>', [EMPTY_ARGS], False, ("", "", [("empty_args", {})])),
    ('<function name="html"><param name="markup"><![CDATA[<a href="/x">hi</a> </param>]]></param></function>', [HTML],
     False, ("", "", [("html", {"markup": '<a href="/x">hi</a> </param>'})])),
    ("I'm thinking</think><function name=\"python\"><param name=\"code\">print('hey')</param></function>", [PYTHON],
     True, ("", "I'm thinking", [("python", {"code": "print('hey')"})])),
    ('<function name="python"><param name="code">print(\'x\')</param></function>\n'
     '<function name="python"><param name="code">print(\'y\')</param></function>', [PYTHON], False,
     ("", "", [("python", {"code": "print('x')"}), ("python", {"code": "print('y')"})])),
    # our own: values typed by the schema (as the template writes them: Python literals for non-strings)
    ('<function name="special_function"><param name="arg1">1</param></function>', [SPECIAL], False,
     ("", "", [("special_function", {"arg1": 1})])),
    ('<function name="pick"><param name="color">red</param><param name="on">True</param></function>', [PICK], False,
     ("", "", [("pick", {"color": "red", "on": True})])),
]


@pytest.mark.parametrize("text, tools, opened, expect", CASES)
def test_expectations(text, tools, opened, expect):
    check("minicpm5", text, tools, opened, expect)


test_what_is_no_call_stays_text = no_call_stays_text(
    "minicpm5", ['<function name="nope"></function>',
                '<function name="python"><param name="code">print(1)</param>',
                '<function name="python"><param name="code">print(1)</function>'], [PYTHON])


def test_detection_over_llama_cpp_templates():
    assert [n for n, f in detections().items() if f == "minicpm5"] == ["openbmb-MiniCPM5-1B.jinja"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return vocabulary(tmp_path_factory.mktemp("minicpm5"), ())


def test_forced_grammar_accepts_calls_and_refuses_junk(tok):
    spec = forced([SPECIAL, PYTHON, PICK], None, True)
    py = '<function name="python"><param name="code">print(1)\nprint(2)</param></function>'
    assert accepts(tok, spec, py)
    assert accepts(tok, spec, '<function name="special_function"><param name="arg1">3</param></function>\n' + py)
    assert not accepts(tok, spec, '<function name="special_function"><param name="arg1">x</param></function>')
    assert not accepts(tok, spec, '<function name="pick"><param name="color">blue</param>'
                                  '<param name="on">true</param></function>')
    assert not accepts(tok, spec, '<function name="special_function"></function>')  # a required param missing
    assert not accepts(tok, forced([SPECIAL, PYTHON], "special_function", True), py)


@pytest.mark.parametrize("seed", range(2))
def test_forced_calls_parse_back(tok, seed):
    calls = forced_calls_parse_back(tok, forced, "minicpm5", seed)
    assert all(c.name == "pick" for c in calls), calls

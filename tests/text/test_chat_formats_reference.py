"""edgeserve's reading of model replies against llama.cpp's chat-parser expectations (tests/chat_format_cases.py).

Every case of tests/data/chat_formats/*.json is run through the server's path (chat_setup(...).parser() fed through
ChatSetup.split): (a) the parse must equal the expectation, (b) streaming the reply in pieces (one character at a
time, random pieces) must read the same as the whole reply. And every chat template of llama.cpp's models/templates/
must render a short conversation with a tool call and its result. What fails today is listed, with a reason, in
tests/data/chat_formats/known_failures.json and runs as a strict xfail: a listed case that starts passing fails
until it is taken off the list (`python tests/chat_format_cases.py --write-known-failures` rewrites it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chat_format_cases import (DATA, KNOWN_FAILURES, Call, check_case, known_failures, load_cases, mismatches,
                               render_error, stream_mismatch, template_names)

CASES = load_cases()
KNOWN = known_failures()


def _params(ids: list[str], kind: str, values: list | None = None) -> list:
    out = []
    for cid, value in zip(ids, values if values is not None else ids):
        reason = KNOWN[kind].get(cid)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(value, id=cid, marks=marks))
    return out


@pytest.mark.parametrize("case", _params([c["id"] for c in CASES], "parse", CASES))
def test_parse_matches_llama_cpp(case):
    problems = check_case(case)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("case", _params([c["id"] for c in CASES], "stream", CASES))
def test_streamed_reads_as_whole(case):
    problem = stream_mismatch(case)
    assert problem is None, problem


@pytest.mark.parametrize("name", _params(template_names(), "render"))
def test_template_renders_tool_conversation(name):
    problem = render_error(name)
    assert problem is None, problem


def test_comparison_follows_llama_cpp():
    """Whitespace around content and reasoning is ignored, arguments compare as JSON (text that does not parse as
    nothing), ids only where the expectation has one; anything else differing is reported."""
    case = {"expect": {"content": "Hi", "reasoning_content": "", "tool_calls": [
        {"name": "f", "arguments": '{"a": 1, "b": [2]}', "id": ""}, {"name": "g", "arguments": '{"x', "id": "7"}]}}
    calls = [Call("f", '{"b":[2],"a":1}', "call_1"), Call("g", '{"y', "7")]
    assert mismatches(case, ("\n Hi \n", " ", calls)) == []
    assert mismatches(case, ("Hi!", "", calls))[0].startswith("content")
    assert mismatches(case, ("Hi", "x", calls))[0].startswith("reasoning")
    assert mismatches(case, ("Hi", "", [Call("f", '{"a": 2, "b": [2]}'), calls[1]]))[0].startswith("call 0 arguments")
    assert mismatches(case, ("Hi", "", [calls[0], Call("g", "{", "8")]))[0].startswith("call 1 id")
    assert mismatches(case, ("Hi", "", calls[:1]))[0].startswith("1 tool calls != 2")


def test_known_failures_name_real_cases():
    """A stale entry (a case or template that no longer exists) would hide nothing and mislead: none allowed."""
    ids = {c["id"] for c in CASES}
    assert set(KNOWN["parse"]) <= ids and set(KNOWN["stream"]) <= ids
    assert set(KNOWN["render"]) <= set(template_names())
    assert all(isinstance(r, str) and r and "\n" not in r for kind in KNOWN.values() for r in kind.values())
    assert json.loads(KNOWN_FAILURES.read_text(encoding="utf-8")).keys() == {"parse", "stream", "render"}


def test_llama_cpp_cases_are_extracted_from_test_chat():
    """The committed cases are what make_llama_cpp_cases.py reads from llama.cpp's test-chat.cpp, every case
    of it read (no `.run()` left behind)."""
    sys.path.insert(0, str(DATA))
    try:
        from make_llama_cpp_cases import extract
    finally:
        sys.path.remove(str(DATA))
    from llama_cpp_source import llama_cpp_dir

    source = (llama_cpp_dir() / "tests" / "test-chat.cpp").read_text(encoding="utf-8")
    cases, failures = extract(source)
    assert failures == []
    assert len(cases) >= source.count(".run()")
    committed = json.loads((DATA / "llama_cpp_cases.json").read_text(encoding="utf-8"))
    assert cases == committed


def test_extraction_reads_cpp_literals(tmp_path):
    """The interpreter's C++: adjacent literals, escapes, raw strings, `+`, named constants, a helper per template."""
    sys.path.insert(0, str(DATA))
    try:
        from make_llama_cpp_cases import extract
    finally:
        sys.path.remove(str(DATA))
    source = r'''
static common_chat_tool special_function_tool{ "special_function", "I'm special", R"({"type": "object"})" };
const common_chat_msg message_assist = simple_assist_msg("Hello, world!\nWhat's up?");
static void helper(const std::string & path, bool debug) {
    auto tst = peg_tester(path, debug);
    tst.test("a" "b\t\x41\u00e9").expect(message_assist).run();
}
static void test_template_output_peg_parsers(bool detailed_debug) {
    for (const char * t : { "models/templates/A.jinja", "models/templates/B.jinja" }) { helper(t, detailed_debug); }
    {
        auto tst = peg_tester("models/templates/C.jinja", detailed_debug);
        const std::string call = R"x(<call>)x";
        tst.test("pre " + call).tools({ special_function_tool }).reasoning_format(COMMON_REASONING_FORMAT_AUTO)
            .expect_tool_calls({ { "special_function", R"({"arg1": 1})", {} } }).run();
    }
}
'''
    cases, failures = extract(source)
    assert failures == []
    assert [c["template"] for c in cases] == ["A.jinja", "B.jinja", "C.jinja"]
    assert cases[0]["input"] == "ab\tA\u00e9" and cases[0]["expect"]["content"] == "Hello, world!\nWhat's up?"
    assert cases[0]["reasoning_format"] == "none" and cases[0]["enable_thinking"] is True  # llama.cpp's defaults
    c = cases[2]
    assert c["input"] == "pre <call>" and c["reasoning_format"] == "auto"
    assert c["tools"][0]["function"] == {"name": "special_function", "description": "I'm special",
                                         "parameters": {"type": "object"}}
    assert c["expect"]["tool_calls"] == [{"name": "special_function", "arguments": '{"arg1": 1}', "id": ""}]
    assert c["id"] == "C.jinja:13:0"  # the line of its .test(


def test_report_runs():
    """`python tests/chat_format_cases.py --report` prints a row per template and the totals."""
    out = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "chat_format_cases.py"), "--report"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    assert "Qwen3.5-4B.jinja" in out and "total" in out

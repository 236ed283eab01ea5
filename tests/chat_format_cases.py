"""Chat-format reference cases: load them, run one through edgeserve's reply parsing, compare with its expectation.

A case (tests/data/chat_formats/*.json, one list of objects per file; llama_cpp_cases.json is extracted from
llama.cpp's tests/test-chat.cpp by make_llama_cpp_cases.py) names a chat template of llama.cpp's
models/templates/, a model reply (`input`), the request's parameters and the message the reply must parse into:

    {"id"?, "template", "line", "input", "tools": [OpenAI tool], "enable_thinking", "reasoning_format",
     "parallel_tool_calls", "tool_choice", "json_schema" (JSON text or object), "messages" (null: one user message),
     "is_partial", "add_generation_prompt", "continue_final_message",
     "expect": {"content", "reasoning_content", "tool_calls": [{"name", "arguments" (JSON text), "id"}]}}

(llama.cpp's cases also say `expect_reconstruction` and `explicit`, the parameters the case set itself, the others
being llama.cpp's defaults; the harness does not read them.) A case without `tools` is a request without tools
(tool_choice "none", as the routes make it), whatever its tool_choice says.

`run_case` takes exactly the server's path: the request's fields parsed by the OpenAI route's own parsers into a
`GenerationRequest`, `chat_setup(req, template)`, then its `.parser()` fed the reply as `RequestOutput` deltas through
`ChatSetup.split`, as `Generation.outputs` does; the last delta finishes with "stop" ("length" for a partial case:
a reply cut short). The reply first goes through what the engine does with it: generation ends at the first of the
format's stop strings (`ChatSetup.stop`: Ling 3's `<|role_end|>`, Laguna's `</assistant>`), matched by the
engine's StopMatcher, the stop text itself never shown and the finish "stop" (`engine_deltas`); a single-token stop
string ends the reply as a stop token, whose text the engine does not show either. A continuation case
(`continue_final_message` "content" / "reasoning": assistant prefill) reads back only the continuation, as the
server returns it, while llama.cpp's expectation is the whole message: the harness puts the prefill first
(`ChatSetup.prefilled`: the final message's content, for a content continuation, and its reasoning where the
reply's reasoning is split off).

Comparison follows llama.cpp's test (`assert_msg_equals` with ignore_whitespace_differences, as its PEG parser tests
call it): content and reasoning equal after stripping leading and trailing whitespace, the same number of calls,
each with the same name and the same arguments as parsed JSON (text that does not parse, as a partial call's
arguments, compares as "nothing"), and the same id where the expectation names one.

    python tests/chat_format_cases.py --report               pass counts per template
    python tests/chat_format_cases.py --write-known-failures  rewrite known_failures.json from today's results
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import zlib
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data" / "chat_formats"
KNOWN_FAILURES = DATA / "known_failures.json"
DEFAULT_USER = {"role": "user", "content": "Hey there!"}  # llama.cpp's message_user, when a case sets no messages
WHITESPACE = " \t\n\r\f\v"  # C's isspace, as llama.cpp's string_strip uses


@dataclasses.dataclass
class Call:
    name: str
    arguments: str
    id: str = ""


def case_id(case: dict, index: int, source: str) -> str:
    """A case's stable id: its own, else `[source/]template:line:index`."""
    if case.get("id"):
        return case["id"]
    prefix = "" if source == "llama_cpp_cases" else source + "/"
    return f"{prefix}{case['template']}:{case.get('line', 0)}:{index}"


def load_cases() -> list[dict]:
    """Every case of tests/data/chat_formats/*.json (known_failures.json aside), each with its `id`."""
    cases, seen = [], set()
    for path in sorted(DATA.glob("*.json")):
        if path == KNOWN_FAILURES:
            continue
        counts: dict[tuple, int] = {}
        for case in json.loads(path.read_text(encoding="utf-8")):
            key = (case["template"], case.get("line", 0))
            cid = case_id(case, counts.get(key, 0), path.stem)
            counts[key] = counts.get(key, 0) + 1
            if cid in seen:
                raise ValueError(f"{path.name}: duplicate case id {cid}")
            seen.add(cid)
            cases.append({**case, "id": cid})
    return cases


def known_failures() -> dict[str, dict[str, str]]:
    """{"parse" | "stream" | "render": {id: one-line reason}}: what fails today, on purpose listed."""
    if not KNOWN_FAILURES.exists():
        return {"parse": {}, "stream": {}, "render": {}}
    data = json.loads(KNOWN_FAILURES.read_text(encoding="utf-8"))
    return {k: data.get(k, {}) for k in ("parse", "stream", "render")}


@lru_cache(maxsize=None)
def template_source(name: str) -> str:
    """The text of llama.cpp's models/templates/<name>."""
    from llama_cpp_source import llama_cpp_dir

    return (llama_cpp_dir() / "models" / "templates" / name).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def chat_template(name: str):
    """The template as edgeserve loads a model's: no BOS / EOS text, as llama.cpp's own tests render it."""
    from edgeserve.loaders.chat_template import ChatTemplate

    return ChatTemplate(template_source(name), "", "")


def build_request(case: dict):
    """The case's request as the OpenAI chat route builds it (its parsers for messages, tools, tool_choice and
    response_format); `think` from enable_thinking, and reasoning_format / add_generation_prompt /
    continue_final_message where GenerationRequest has such fields."""
    from edgeserve.server.api.openai import parse_response_format
    from edgeserve.server.messages import parse_messages
    from edgeserve.server.request import GenerationRequest
    from edgeserve.server.tools import parse_tools, set_tools

    req = GenerationRequest(model="reference")
    req.messages = parse_messages(case.get("messages") or [DEFAULT_USER])
    body = {"tool_choice": case.get("tool_choice") if case.get("tools") else None,
            "parallel_tool_calls": case.get("parallel_tool_calls")}
    set_tools(req, parse_tools(case.get("tools") or None), body)
    req.think = case.get("enable_thinking")
    if case.get("json_schema"):
        schema = case["json_schema"]  # JSON text (llama.cpp's cases) or the schema itself (our own files)
        schema = json.loads(schema) if isinstance(schema, str) else schema
        req.constraint = parse_response_format({"type": "json_schema", "json_schema": {"name": "case",
                                                                                      "schema": schema}})
    fields = {f.name for f in dataclasses.fields(GenerationRequest)}
    for key in ("reasoning_format", "add_generation_prompt", "continue_final_message"):
        if key in fields and case.get(key) is not None and (key, case[key]) != ("continue_final_message", "none"):
            setattr(req, key, case[key])
    return req


def run_case(case: dict, chunks: list[str] | None = None) -> tuple[str, str, list[Call]]:
    """(content, reasoning, tool calls) the server reads from the case's reply, fed whole or as `chunks`."""
    from edgeserve.engine.outputs import RequestOutput
    from edgeserve.server.chat_setup import chat_setup
    from edgeserve.text.stop import StopMatcher

    setup = chat_setup(build_request(case), chat_template(case["template"]))
    parser = setup.parser()
    pieces = chunks if chunks is not None else [case["input"]]
    if "".join(pieces) != case["input"]:
        raise ValueError("the chunks do not make up the case's input")
    reasoning, content = setup.prefilled  # a continuation: llama.cpp's message includes the prefill
    calls: list[Call] = []
    stops = StopMatcher(list(setup.stop))
    for text, finish in engine_deltas(pieces or [""], stops, "length" if case.get("is_partial") else "stop"):
        out = RequestOutput("case", text, [], None, finish)
        setup.split(parser, out)
        content += out.text
        reasoning += out.reasoning
        calls += [Call(c.name, c.arguments, c.id) for c in out.tool_calls or []]
    return content, reasoning, calls


def engine_deltas(pieces: list[str], stops, finish: str) -> list[tuple[str, str | None]]:
    """The (text, finish_reason) deltas the engine sends for a reply generated as `pieces`: its format's stop
    strings (`ChatSetup.stop`) matched by the engine's own StopMatcher, so the reply ends before the first one (its
    text never shown) with finish "stop"; otherwise the last piece finishes with `finish`."""
    out: list[tuple[str, str | None]] = []
    for i, piece in enumerate(pieces):
        text, stopped = stops.push(piece)
        if stopped:
            return [*out, (text, "stop")]
        last = i == len(pieces) - 1
        out.append((text + stops.flush(), finish) if last else (text, None))
    return out


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None  # as llama.cpp's renormalize_json: partial JSON compares as nothing


def _short(text: Any, n: int = 60) -> str:
    s = json.dumps(text, ensure_ascii=False)
    return s if len(s) <= n else s[:n - 3] + "..."


def mismatches(case: dict, got: tuple[str, str, list[Call]]) -> list[str]:
    """How the parse differs from the case's expectation (empty when it matches), one short line each."""
    content, reasoning, calls = got
    want = case["expect"]
    out = []
    if content.strip(WHITESPACE) != want.get("content", "").strip(WHITESPACE):
        out.append(f"content {_short(content)} != {_short(want.get('content', ''))}")
    if reasoning.strip(WHITESPACE) != want.get("reasoning_content", "").strip(WHITESPACE):
        out.append(f"reasoning {_short(reasoning)} != {_short(want.get('reasoning_content', ''))}")
    wcalls = want.get("tool_calls", [])
    if len(calls) != len(wcalls):
        out.append(f"{len(calls)} tool calls != {len(wcalls)} {[c['name'] for c in wcalls]}")
        return out
    for i, (c, w) in enumerate(zip(calls, wcalls)):
        if c.name != w["name"]:
            out.append(f"call {i} name {c.name!r} != {w['name']!r}")
        if _json_or_none(c.arguments) != _json_or_none(w.get("arguments", "")):
            out.append(f"call {i} arguments {_short(c.arguments)} != {_short(w.get('arguments', ''))}")
        if w.get("id") and c.id != w["id"]:
            out.append(f"call {i} id {c.id!r} != {w['id']!r}")
    return out


def check_case(case: dict) -> list[str]:
    """mismatches(), with an error raised on the way reported as one."""
    try:
        return mismatches(case, run_case(case))
    except Exception as e:  # noqa: BLE001 -- a failing case is a result here
        return [f"error {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]]


def chunkings(text: str, seed: str) -> dict[str, list[str]]:
    """The streamed splits of `text` the tests try: one character at a time, random pieces of 1-8 characters
    from a seed fixed per case, and the whole text with the finish in a delta of its own (as when the
    end-of-turn token has no text)."""
    rng = random.Random(zlib.crc32(seed.encode()))
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 8)
        pieces.append(text[i:i + n])
        i += n
    return {"chars": list(text), "random": pieces, "finish_apart": [text, ""]}


def stream_mismatch(case: dict) -> str | None:
    """Why streaming the case's reply reads differently from the whole reply (None when every chunking agrees):
    content, reasoning and the calls' names and arguments must be equal exactly."""
    try:
        whole = run_case(case)
        for name, pieces in chunkings(case["input"], case["id"]).items():
            got = run_case(case, pieces)
            if got[0] != whole[0]:
                return f"{name}: content {_short(got[0])} != whole {_short(whole[0])}"
            if got[1] != whole[1]:
                return f"{name}: reasoning {_short(got[1])} != whole {_short(whole[1])}"
            if [(c.name, c.arguments) for c in got[2]] != [(c.name, c.arguments) for c in whole[2]]:
                return f"{name}: calls {_short([(c.name, c.arguments) for c in got[2]])} != whole"
    except Exception as e:  # noqa: BLE001
        return f"error {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return None


# ---------------------------------------------------------------- templates render


def template_names() -> list[str]:
    """Every chat template of llama.cpp's models/templates/."""
    from llama_cpp_source import llama_cpp_dir

    return sorted(p.name for p in (llama_cpp_dir() / "models" / "templates").glob("*.jinja"))


RENDER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}]
RENDER_MESSAGES = [  # the call id is 9 alphanumerics, as Mistral's templates demand
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a1b2c3d4e", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "It is 21 degrees in Paris."},
    {"role": "user", "content": "Thanks!"},
]


def render_error(name: str) -> str | None:
    """Why a simple conversation with a tool call and its result does not render through the server's path with
    llama.cpp's template `name` (None when it renders and shows the conversation's text)."""
    from edgeserve.server.chat_setup import chat_setup

    case = {"template": name, "messages": RENDER_MESSAGES, "tools": RENDER_TOOLS, "tool_choice": "auto"}
    try:
        prompt = chat_setup(build_request(case), chat_template(name)).prompt
    except Exception as e:  # noqa: BLE001
        return f"error {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    missing = [t for t in ("get_weather", "What is the weather in Paris?", "It is 21 degrees in Paris.", "Thanks!")
               if t not in prompt]
    return f"the prompt lacks {missing[0]!r}" if missing else None


# ---------------------------------------------------------------- the command line


def results() -> dict[str, dict[str, str | None]]:
    """Today's result of every check: {"parse" | "stream" | "render": {id: failure reason or None}}."""
    cases = load_cases()
    parse = {c["id"]: ("; ".join(m) or None) for c in cases for m in [check_case(c)]}
    stream = {c["id"]: stream_mismatch(c) for c in cases}
    render = {name: render_error(name) for name in template_names()}
    return {"parse": parse, "stream": stream, "render": render}


def report(res: dict[str, dict[str, str | None]]) -> str:
    """Pass counts per template: every case, the cases with tools, those that expect tool calls, streaming."""
    cases = {c["id"]: c for c in load_cases()}
    rows: dict[str, list[int]] = {}
    for cid, case in cases.items():
        row = rows.setdefault(case["template"], [0] * 7)
        ok = res["parse"][cid] is None
        tools, calls = bool(case.get("tools")), bool(case["expect"].get("tool_calls"))
        for k, counted in enumerate((True, tools, calls)):
            row[2 * k] += ok and counted
            row[2 * k + 1] += counted
        row[6] += res["stream"][cid] is None
    lines = [f"{'template':52} {'parse':>9} {'tools':>9} {'calls':>9} {'stream':>9}"]
    tot = [sum(r[i] for r in rows.values()) for i in range(7)]
    for name, r in [*sorted(rows.items()), ("total", tot)]:
        lines.append(f"{name:52} " + " ".join(f"{r[2 * k]:4d}/{r[2 * k + 1]:<4d}" for k in range(3))
                     + f" {r[6]:4d}/{r[1]:<4d}")
    rok = sum(v is None for v in res["render"].values())
    lines.append(f"templates rendering a tool conversation: {rok}/{len(res['render'])}")
    return "\n".join(lines)


def _tag(case: dict | None) -> str:
    """A failing case's traits that edgeserve's request lacks a field for, as a prefix of its reason."""
    if case is None:
        return ""
    tags = [f"continue_final_message={case['continue_final_message']}"
            for _ in [0] if case.get("continue_final_message", "none") != "none"]
    tags += ["reasoning_format=none" for _ in [0] if case.get("reasoning_format") == "none"
             and case.get("enable_thinking") is not False]
    tags += ["partial" for _ in [0] if case.get("is_partial")]
    return "".join(f"[{t}] " for t in tags)


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if not argv or argv[0] not in ("--report", "--write-known-failures"):
        print("usage: python tests/chat_format_cases.py --report | --write-known-failures", file=sys.stderr)
        return 2
    res = results()
    print(report(res))
    if argv[0] == "--write-known-failures":
        cases = {c["id"]: c for c in load_cases()}
        data = {kind: {k: (_tag(cases.get(k)) + v) for k, v in sorted(vals.items()) if v is not None}
                for kind, vals in res.items()}
        KNOWN_FAILURES.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {KNOWN_FAILURES}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

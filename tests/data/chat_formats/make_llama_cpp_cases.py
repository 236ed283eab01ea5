"""Extract llama.cpp's chat-parser test cases (tests/test-chat.cpp) into llama_cpp_cases.json.

Every `tst.test(input)...run()` chain of llama.cpp's PEG parser tests (`test_template_output_peg_parsers`, and the
shared helpers such as `test_lfm2_parser(template_path)`, expanded per template they are called with) becomes one
JSON case: the template, the model's reply text, the request's parameters (their effective values: llama.cpp's
`common_chat_templates_inputs` defaults where a case sets none) and the message llama.cpp's parser must read from it.

The C++ is read by a small interpreter for the subset the tests use: string literals (adjacent-literal
concatenation, escapes, raw strings), `+` on strings, brace initializer lists, local variables and member
assignments, range-for loops over literal lists, and calls of the helper functions. The named tools are parsed from
their definitions in the file; the message helpers (`simple_assist_msg(...)` and friends) are rewritten below from
their C++ definitions, and the message constants are evaluated from the file through them.

    python tests/data/chat_formats/make_llama_cpp_cases.py [path/to/test-chat.cpp]

prints the counts per template and any `.run()` statement it could not read.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "llama_cpp_cases.json"
FUNCTIONS = ("test_template_output_peg_parsers",)  # the entry points; helpers they call are followed

# llama.cpp's enum values, as llama-server's request fields name them
ENUMS = {
    "COMMON_REASONING_FORMAT_NONE": "none",
    "COMMON_REASONING_FORMAT_AUTO": "auto",
    "COMMON_REASONING_FORMAT_DEEPSEEK": "deepseek",
    "COMMON_REASONING_FORMAT_DEEPSEEK_LEGACY": "deepseek-legacy",
    "COMMON_CHAT_TOOL_CHOICE_AUTO": "auto",
    "COMMON_CHAT_TOOL_CHOICE_REQUIRED": "required",
    "COMMON_CHAT_TOOL_CHOICE_NONE": "none",
    "COMMON_CHAT_CONTINUATION_NONE": "none",
    "COMMON_CHAT_CONTINUATION_AUTO": "auto",
    "COMMON_CHAT_CONTINUATION_REASONING": "reasoning",
    "COMMON_CHAT_CONTINUATION_CONTENT": "content",
    "true": True,
    "false": False,
    "nullptr": None,
}

# common_chat_templates_inputs' defaults (common/chat.h), recorded where a case sets nothing
DEFAULTS = {"enable_thinking": True, "reasoning_format": "none", "parallel_tool_calls": False, "tool_choice": "auto",
            "json_schema": None, "messages": None, "add_generation_prompt": True, "continue_final_message": "none"}


# ---------------------------------------------------------------- tokens


@dataclass
class Tok:
    kind: str  # "str", "id", "num", "chr", "op"
    value: Any  # str tokens: bytes
    line: int


_PUNCT = ("::", "->", "&&", "||", "==", "!=", "<=", ">=", "+=", "-=", "++", "--", "<<", ">>")
_STR_START = re.compile(r'(u8|u|U|L)?(R)?"')


def _escape(src: str, i: int, out: bytearray) -> int:
    """Decode the C++ escape at src[i] (just after the backslash) into out; the index after it."""
    c = src[i]
    simple = {"n": 10, "t": 9, "r": 13, "0": 0, "a": 7, "b": 8, "f": 12, "v": 11, "\\": 92, '"': 34, "'": 39, "?": 63}
    if c == "x":
        m = re.match(r"[0-9a-fA-F]+", src[i + 1:])
        out.append(int(m.group(0), 16) & 0xFF)
        return i + 1 + len(m.group(0))
    if c in "uU":
        n = 4 if c == "u" else 8
        out += chr(int(src[i + 1:i + 1 + n], 16)).encode()
        return i + 1 + n
    if c in "01234567" and re.match(r"[0-7]{2}", src[i:i + 3] + "x"):
        m = re.match(r"[0-7]{1,3}", src[i:])
        out.append(int(m.group(0), 8) & 0xFF)
        return i + len(m.group(0))
    if c in simple:
        out.append(simple[c])
        return i + 1
    raise ValueError(f"unknown escape \\{c}")


def _string_literal(src: str, m: re.Match) -> tuple[bytes, int]:
    """The bytes of the string literal whose opening `m` matched, and the index after it."""
    if m.group(2):  # raw string R"delim( ... )delim"
        j = src.index("(", m.end())
        delim = src[m.end():j]
        end = src.index(")" + delim + '"', j)
        return src[j + 1:end].encode(), end + len(delim) + 2
    i, out = m.end(), bytearray()
    while src[i] != '"':
        if src[i] == "\\":
            i = _escape(src, i + 1, out)
        else:
            out += src[i].encode()
            i += 1
    return bytes(out), i + 1


def tokenize(src: str) -> list[Tok]:
    """C++ tokens (comments and preprocessor lines dropped); string literals decoded to bytes."""
    toks: list[Tok] = []
    i, line, n = 0, 1, len(src)
    at_line_start = True
    while i < n:
        c = src[i]
        if c == "\n":
            line, i, at_line_start = line + 1, i + 1, True
            continue
        if c.isspace():
            i += 1
            continue
        if at_line_start and c == "#":
            while i < n and src[i] != "\n":
                i += 2 if src[i] == "\\" else 1
            continue
        at_line_start = False
        if src.startswith("//", i):
            i = src.find("\n", i)
            i = n if i < 0 else i
            continue
        if src.startswith("/*", i):
            j = src.index("*/", i)
            line += src.count("\n", i, j)
            i = j + 2
            continue
        m = _STR_START.match(src, i)
        if m and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            data, end = _string_literal(src, m)
            toks.append(Tok("str", data, line))
            line += src.count("\n", i, end)
            i = end
            continue
        if c == "'":
            j = i + 1
            out = bytearray()
            while src[j] != "'":
                j = _escape(src, j + 1, out) if src[j] == "\\" else j + 1
            toks.append(Tok("chr", src[i:j + 1], line))
            i = j + 1
            continue
        if c.isalpha() or c == "_":
            m = re.compile(r"[A-Za-z_0-9]+").match(src, i)
            toks.append(Tok("id", m.group(0), line))
            i = m.end()
            continue
        if c.isdigit():
            m = re.compile(r"[0-9][0-9A-Za-z_.']*").match(src, i)
            toks.append(Tok("num", m.group(0), line))
            i = m.end()
            continue
        op = next((p for p in _PUNCT if src.startswith(p, i)), c)
        toks.append(Tok("op", op, line))
        i += len(op)
    return toks


def _close(toks: list[Tok], i: int) -> int:
    """Index of the bracket closing the one at toks[i]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth = 0
    for j in range(i, len(toks)):
        t = toks[j]
        if t.kind == "op" and t.value in pairs:
            depth += 1
        elif t.kind == "op" and t.value in (")", "}", "]"):
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"unbalanced bracket from line {toks[i].line}")


def _split_top(toks: list[Tok], sep: str = ",") -> list[list[Tok]]:
    """toks split at depth-0 separators (empty trailing part dropped)."""
    parts, cur, depth = [], [], 0
    for t in toks:
        if t.kind == "op" and t.value in ("(", "{", "["):
            depth += 1
        elif t.kind == "op" and t.value in (")", "}", "]"):
            depth -= 1
        if depth == 0 and t.kind == "op" and t.value == sep:
            parts.append(cur)
            cur = []
        else:
            cur.append(t)
    if cur:
        parts.append(cur)
    return parts


# ---------------------------------------------------------------- values


def msg(role: str = "", content: str = "", reasoning: str = "", calls: list | None = None) -> dict:
    """A common_chat_msg."""
    return {"role": role, "content": content, "content_parts": [], "tool_calls": list(calls or []),
            "reasoning_content": reasoning, "tool_name": "", "tool_call_id": ""}


def call(name: str, arguments: str = "", id: str = "") -> dict:
    return {"name": name, "arguments": arguments, "id": id}


def simple_assist_msg(content: str, reasoning: str = "", tool_name: str = "", arguments: str = "",
                      id: str = "") -> dict:
    calls = [call(tool_name, arguments, id)] if tool_name or id else []
    return msg("assistant", content, reasoning, calls)


# the message helpers of test-chat.cpp (their C++ definitions read to write these)
HELPERS = {
    "simple_assist_msg": simple_assist_msg,
    "message_with_tool_calls": lambda name, args: simple_assist_msg("", "", name, args),
    "message_with_tool_calls_and_reasoning": lambda name, args, reasoning: simple_assist_msg("", reasoning, name, args),
    "message_with_reasoning_content_and_multiple_tool_calls":
        lambda reasoning, content, calls: msg("assistant", content, reasoning, [call(*c) for c in calls]),
    "message_with_content_and_tool_call": lambda content, name, args: simple_assist_msg(content, "", name, args),
    "message_with_reasoning_and_tool_call": lambda reasoning, name, args: simple_assist_msg("", reasoning, name, args),
}

MSG_FIELDS = ("role", "content", "content_parts", "tool_calls", "reasoning_content", "tool_name", "tool_call_id")


def _text(v: Any) -> str:
    if isinstance(v, list) and not v:  # `{}` for an empty string
        return ""
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {v!r}")
    return v


def construct(type_name: str, items: list) -> Any:
    """A brace-initialised value of a known C++ type."""
    if type_name == "common_chat_tool":
        name, desc, params = (_text(x) for x in items)
        return {"kind": "tool", "name": name, "description": desc, "parameters": params}
    if type_name == "common_chat_msg":
        m = msg()
        for key, value in zip(MSG_FIELDS, items):
            m[key] = value if key in ("content_parts", "tool_calls") else _text(value)
        m["content_parts"] = [{"type": _text(p[0]), "text": _text(p[1])} for p in m["content_parts"]]
        m["tool_calls"] = [as_call(c) for c in m["tool_calls"]]
        return m
    if type_name in ("vector", "common_chat_tool_call"):
        return items if type_name == "vector" else as_call(items)
    raise TypeError(f"no brace initialisation for {type_name}")


def as_call(v: Any) -> dict:
    """A common_chat_tool_call from `{name, arguments, id}`."""
    if isinstance(v, dict) and "arguments" in v:
        return v
    parts = [_text(x) for x in v] + ["", ""]
    return call(parts[0], parts[1], parts[2])


@dataclass
class Tester:
    template: str


@dataclass
class Builder:
    tester: Tester
    line: int
    input: str
    params: dict = field(default_factory=dict)
    expect: dict = field(default_factory=lambda: msg("assistant"))
    is_partial: bool = False
    expect_reconstruction: bool = False


# ---------------------------------------------------------------- the interpreter


# the words a local declaration starts with in the test functions
DECL_STARTS = ("static", "const", "auto", "std", "char", "common_chat_msg", "common_chat_tool",
               "common_chat_templates_inputs")


class Unsupported(Exception):
    pass


class Interpreter:
    def __init__(self, toks: list[Tok]):
        self.toks = toks
        self.globals: dict[str, Any] = {}
        self.functions: dict[str, tuple[list[str], int, int]] = {}  # name -> (params, body start, body end)
        self.cases: list[dict] = []
        self.failures: list[str] = []
        self.skipped = 0

    # ---- top level

    def scan_top(self) -> None:
        """Record the file's global tools, messages and vectors and its function bodies."""
        toks, i = self.toks, 0
        while i < len(toks):
            j = i
            while j < len(toks) and not (toks[j].kind == "op" and toks[j].value in (";", "{", "(")):
                j += 1
            if j >= len(toks):
                break
            t = toks[j]
            if t.value == "(" and toks[i].value in ("static", "const") and any(x.value == "=" for x in toks[i:j]):
                end = self._skip_statement(i)
                self._declare_global_assign(toks[i:end - 1])
                i = end
                continue
            if t.value == "(":  # a function (or a call / operator): find its body or end
                close = _close(toks, j)
                k = close + 1
                while k < len(toks) and toks[k].kind == "id" and toks[k].value in ("const", "override", "noexcept"):
                    k += 1
                if k < len(toks) and toks[k].value == "{":
                    end = _close(toks, k)
                    name = toks[j - 1].value
                    params = [p[-1].value for p in _split_top(toks[j + 1:close]) if p and p[-1].kind == "id"]
                    self.functions[name] = (params, k + 1, end)
                    i = end + 1
                else:
                    i = self._skip_statement(i)
                continue
            if t.value == "{" and j > i and toks[j - 1].kind == "id" and toks[i].value in ("static", "const"):
                end = _close(toks, j)
                self._declare_global(toks[i:j], toks[j:end + 1])
                i = end + 1
                continue
            if t.value == "{":  # struct / class / namespace / enum body
                i = _close(toks, j) + 1
                continue
            if toks[i].value in ("static", "const") and any(x.value == "=" for x in toks[i:j]):
                self._declare_global_assign(toks[i:j])
            i = j + 1

    def _skip_statement(self, i: int) -> int:
        toks, depth = self.toks, 0
        while i < len(toks):
            v = toks[i].value if toks[i].kind == "op" else None
            if v in ("(", "{", "["):
                depth += 1
            elif v in (")", "}", "]"):
                depth -= 1
            elif v == ";" and depth == 0:
                return i + 1
            i += 1
        return i

    def _declare_global(self, head: list[Tok], brace: list[Tok]) -> None:
        name = head[-1].value
        type_name = self._type_of(head[:-1])
        try:
            self.globals[name] = construct(type_name, self.eval_list(brace[1:-1], {}))
        except (Unsupported, TypeError, ValueError, KeyError):
            pass  # a global the cases do not use

    def _declare_global_assign(self, stmt: list[Tok]) -> None:
        eq = next(k for k, t in enumerate(stmt) if t.value == "=")
        if stmt[eq - 1].kind != "id":
            return
        try:
            self.globals[stmt[eq - 1].value] = self.eval(stmt[eq + 1:], {})
        except (Unsupported, TypeError, ValueError, KeyError):
            pass

    @staticmethod
    def _type_of(head: list[Tok]) -> str:
        names = [t.value for t in head if t.kind == "id" and t.value not in ("static", "const", "std", "auto")]
        return "vector" if "vector" in names else names[-1] if names else "auto"

    # ---- statements

    def _makes_cases(self, name: str) -> bool:
        _, start, end = self.functions[name]
        return any(t.kind == "id" and t.value == "peg_tester" for t in self.toks[start:end])

    def run_function(self, name: str, args: list) -> None:
        params, start, end = self.functions[name]
        env = {"__parent__": None, **dict(zip(params, args))}
        self.exec_block(start, end, env)

    def exec_block(self, i: int, end: int, env: dict) -> None:
        toks = self.toks
        while i < end:
            t = toks[i]
            if t.value == "{" and t.kind == "op":
                close = _close(toks, i)
                self.exec_block(i + 1, close, {"__parent__": env})
                i = close + 1
            elif t.kind == "id" and t.value == "for":
                i = self._exec_for(i, env)
            elif t.kind == "id" and t.value in ("if", "while", "try", "switch", "do"):
                i = self._skip_compound(i)
            elif t.kind == "op" and t.value == ";":
                i += 1
            else:
                j = self._skip_statement(i)
                self.exec_statement(toks[i:j - 1], env)
                i = j

    def _skip_compound(self, i: int) -> int:
        """Skip an if/while/try statement (with its else / catch parts); report a skipped case inside it."""
        toks, start = self.toks, i
        while True:
            i += 1
            if i < len(toks) and toks[i].value == "(":
                i = _close(toks, i) + 1
            i = _close(toks, i) + 1 if toks[i].value == "{" else self._skip_statement(i)
            if i < len(toks) and toks[i].value in ("else", "catch"):
                continue
            break
        if any(t.kind == "id" and t.value == "run" for t in toks[start:i]):
            self.failures.append(f"line {toks[start].line}: a case inside an if/try statement is not extracted")
        return i

    def _exec_for(self, i: int, env: dict) -> int:
        toks = self.toks
        close = _close(toks, i + 1)
        header = toks[i + 2:close]
        colon = next(k for k, t in enumerate(header) if t.value == ":")
        var = header[colon - 1].value
        values = self.eval(header[colon + 1:], env)
        body_start = close + 1
        body_end = _close(toks, body_start) if toks[body_start].value == "{" else self._skip_statement(body_start) - 1
        for v in values:
            scope = {"__parent__": env, var: v}
            if toks[body_start].value == "{":
                self.exec_block(body_start + 1, body_end, scope)
            else:
                self.exec_statement(toks[body_start:body_end], scope)
        return body_end + 1

    def exec_statement(self, stmt: list[Tok], env: dict) -> None:
        try:
            self._statement(stmt, env)
        except (Unsupported, TypeError, ValueError, KeyError, StopIteration, IndexError) as e:
            if any(t.kind == "id" and t.value == "run" for t in stmt):
                self.failures.append(f"line {stmt[0].line}: {type(e).__name__}: {e}")
            else:
                self.skipped += 1

    def _statement(self, stmt: list[Tok], env: dict) -> None:
        eq = next((k for k, t in enumerate(stmt) if t.kind == "op" and t.value == "="), None)
        head = stmt[:eq] if eq is not None else stmt
        if eq is not None and len(head) >= 3 and head[-2].value == "." and head[0].kind == "id" and len(head) == 3:
            target = self.lookup(head[0].value, env)  # x.field = value
            target[head[2].value] = self.eval(stmt[eq + 1:], env)
            return
        if head and head[0].kind == "id" and head[0].value in DECL_STARTS:
            if eq is not None:
                env[head[-1].value] = self.eval(stmt[eq + 1:], env)
            elif stmt[-1].value == "}":  # Type name{...}
                brace = next(k for k, t in enumerate(stmt) if t.value == "{")
                env[stmt[brace - 1].value] = construct(self._type_of(stmt[:brace - 1]),
                                                       self.eval_list(stmt[brace + 1:-1], env))
            else:  # Type name;
                env[stmt[-1].value] = msg() if self._type_of(stmt[:-1]) == "common_chat_msg" else {}
            return
        self.eval(stmt, env)

    def lookup(self, name: str, env: dict | None) -> Any:
        while env is not None:
            if name in env:
                return env[name]
            env = env.get("__parent__")
        if name in self.globals:
            return self.globals[name]
        if name in ENUMS:
            return ENUMS[name]
        raise KeyError(f"unknown name {name}")

    # ---- expressions

    def eval_list(self, toks: list[Tok], env: dict) -> list:
        return [self.eval(p, env) for p in _split_top(toks)]

    def eval(self, toks: list[Tok], env: dict) -> Any:
        parts = _split_top(toks, "+")
        values = [self._postfix(p, env) for p in parts]
        if len(values) == 1:
            return values[0]
        if not all(isinstance(v, str) for v in values):
            raise Unsupported("+ on non-strings")
        return "".join(values)

    def _postfix(self, toks: list[Tok], env: dict) -> Any:
        value, i = self._primary(toks, env)
        while i < len(toks):
            if toks[i].value != "." or toks[i + 1].kind != "id":
                raise Unsupported(f"unexpected {toks[i].value!r} at line {toks[i].line}")
            name, line, i = toks[i + 1].value, toks[i + 1].line, i + 2
            args: list = []
            if i < len(toks) and toks[i].value == "(":
                close = _close(toks, i)
                args, i = self.eval_list(toks[i + 1:close], env), close + 1
            value = self.method(value, name, args, line)
        return value

    def _primary(self, toks: list[Tok], env: dict) -> tuple[Any, int]:
        t = toks[0]
        if t.kind == "str":
            i, data = 0, b""
            while i < len(toks) and toks[i].kind == "str":
                data, i = data + toks[i].value, i + 1
            return data.decode("utf-8"), i
        if t.kind == "num":
            return (float(t.value) if "." in t.value else int(t.value.rstrip("uUlL"))), 1
        if t.value == "{":
            close = _close(toks, 0)
            return self.eval_list(toks[1:close], env), close + 1
        if t.value == "(":
            close = _close(toks, 0)
            return self.eval(toks[1:close], env), close + 1
        if t.kind != "id":
            raise Unsupported(f"unexpected {t.value!r} at line {t.line}")
        i, name = 1, t.value
        while i + 1 < len(toks) and toks[i].value == "::":  # std::string, std::vector<...>
            name, i = toks[i + 1].value, i + 2
        if i < len(toks) and toks[i].value == "<" and name == "vector":
            while toks[i].value != ">":
                i += 1
            i += 1
        if i < len(toks) and toks[i].value in ("(", "{"):
            close = _close(toks, i)
            args = self.eval_list(toks[i + 1:close], env)
            return self.call(name, args, toks[i].value, t.line), close + 1
        return self.lookup(name, env), i

    def call(self, name: str, args: list, bracket: str, line: int) -> Any:
        if name in HELPERS:
            return HELPERS[name](*args)
        if name == "string":
            return _text(args[0]) if args else ""
        if name == "peg_tester":
            return Tester(Path(args[0]).name)
        if name in self.functions and self._makes_cases(name):  # a shared helper such as test_lfm2_parser
            self.run_function(name, args)
            return None
        if bracket == "{":
            return construct(name, args)
        raise Unsupported(f"call of {name} at line {line}")

    def method(self, obj: Any, name: str, args: list, line: int) -> Any:
        if isinstance(obj, Tester) and name == "test":
            return Builder(obj, line, _text(args[0]))
        if isinstance(obj, str) and name == "c_str":
            return obj
        if not isinstance(obj, Builder):
            raise Unsupported(f".{name}() on {type(obj).__name__} at line {line}")
        b = obj
        if name in ("reasoning_format", "enable_thinking", "parallel_tool_calls", "add_generation_prompt",
                    "continue_final_message", "json_schema", "tool_choice"):
            b.params[name] = args[0]
        elif name == "tools":
            b.params["tools"] = [t if isinstance(t, dict) else construct("common_chat_tool", t) for t in args[0]]
        elif name == "messages":
            b.params["messages"] = args[0]
        elif name == "is_partial":
            b.is_partial = bool(args[0])
        elif name == "expect_reconstruction":
            b.expect_reconstruction = bool(args[0]) if args else True
        elif name == "expect":
            b.expect = {**args[0], "tool_calls": [dict(c) for c in args[0]["tool_calls"]]}
        elif name == "expect_content":
            b.expect["content"] = _text(args[0])
        elif name == "expect_reasoning":
            b.expect["reasoning_content"] = _text(args[0])
        elif name == "expect_tool_calls":
            b.expect["tool_calls"] = [as_call(c) for c in args[0]]
        elif name == "run":
            self.cases.append(case_json(b))
        else:
            raise Unsupported(f"builder method {name} at line {line}")
        return b


# ---------------------------------------------------------------- output


def tool_json(tool: dict) -> dict:
    """A common_chat_tool as an OpenAI tool definition."""
    if not isinstance(tool, dict) or tool.get("kind") != "tool":
        raise TypeError(f"not a tool: {tool!r}")
    fn = {"name": tool["name"], "description": tool["description"], "parameters": json.loads(tool["parameters"])}
    return {"type": "function", "function": fn}


def message_json(m: dict) -> dict:
    """A common_chat_msg as an OpenAI-shaped chat message (edgeserve's message fields)."""
    out: dict[str, Any] = {"role": m["role"]}
    out["content"] = [dict(p) for p in m["content_parts"]] if m["content_parts"] else m["content"]
    if m["reasoning_content"]:
        out["reasoning_content"] = m["reasoning_content"]
    if m["tool_calls"]:
        out["tool_calls"] = [{"id": c["id"] or None, "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
    if m["tool_call_id"]:
        out["tool_call_id"] = m["tool_call_id"]
    if m["tool_name"]:
        out["tool_name"] = m["tool_name"]
    return out


def case_json(b: Builder) -> dict:
    p = b.params
    eff = {k: p.get(k, v) for k, v in DEFAULTS.items()}
    return {
        "template": b.tester.template,
        "line": b.line,
        "input": b.input,
        "tools": [tool_json(t) for t in p.get("tools", [])],
        "enable_thinking": eff["enable_thinking"],
        "reasoning_format": eff["reasoning_format"],
        "parallel_tool_calls": eff["parallel_tool_calls"],
        "tool_choice": eff["tool_choice"],
        "json_schema": eff["json_schema"],
        "messages": [message_json(m) for m in p["messages"]] if "messages" in p else None,
        "add_generation_prompt": eff["add_generation_prompt"],
        "continue_final_message": eff["continue_final_message"],
        "is_partial": b.is_partial,
        "expect_reconstruction": b.expect_reconstruction,
        "explicit": sorted(k for k in p if k != "tools"),  # the parameters the case set itself
        "expect": {"content": b.expect["content"], "reasoning_content": b.expect["reasoning_content"],
                   "tool_calls": [dict(c) for c in b.expect["tool_calls"]]},
    }


def with_ids(cases: list[dict]) -> list[dict]:
    """Each case given its stable id: template, line and its index among the cases of that template and line."""
    seen: Counter = Counter()
    out = []
    for c in cases:
        key = (c["template"], c["line"])
        out.append({"id": f"{c['template']}:{c['line']}:{seen[key]}", **c})
        seen[key] += 1
    return out


def extract(source: str) -> tuple[list[dict], list[str]]:
    """The cases of test-chat.cpp's source, and the statements with a case that could not be read."""
    interp = Interpreter(tokenize(source))
    interp.scan_top()
    for name in FUNCTIONS:
        interp.run_function(name, [False])
    return with_ids(interp.cases), interp.failures


def main(argv: list[str]) -> int:
    if argv:
        path = Path(argv[0])
    else:
        sys.path.insert(0, str(HERE.parent.parent))
        from llama_cpp_source import llama_cpp_dir

        path = llama_cpp_dir() / "tests" / "test-chat.cpp"
    source = path.read_text(encoding="utf-8")
    cases, failures = extract(source)
    runs = len(re.findall(r"\.run\(\)", source))
    lines = ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases)  # one case a line: diffs stay readable
    OUT.write_text("[\n" + lines + "\n]\n", encoding="utf-8")
    per = Counter(c["template"] for c in cases)
    for name, n in sorted(per.items()):
        print(f"{n:4d}  {name}")
    calls = sum(1 for c in cases if c["expect"]["tool_calls"])
    print(f"{len(cases)} cases ({calls} expecting tool calls) over {len(per)} templates, from {runs} .run() sites;"
          f" written to {OUT.name}")
    for f in failures:
        print("NOT EXTRACTED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

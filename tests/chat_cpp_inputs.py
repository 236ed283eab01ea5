"""The model text of one case in llama.cpp's tests/test-chat.cpp, read from the source: the C string literals
(plain and raw, adjacent ones joined) passed to the `tst.test(` call that starts on a given line. Tests that copy
cases from that file into tables check each copy against it."""

from __future__ import annotations

import re
from functools import lru_cache

from llama_cpp_source import llama_cpp_dir

_PLAIN = re.compile(r'"((?:[^"\\\n]|\\.)*)"')
_RAW = re.compile(r'R"([^(\s]*)\((.*?)\)\1"', re.S)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "'": "'", "\\": "\\", "0": "\0"}


@lru_cache(maxsize=1)
def _source() -> tuple[str, list[int]]:
    text = (llama_cpp_dir() / "tests" / "test-chat.cpp").read_text()
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    return text, starts


def input_at(line: int) -> str:
    """The text of the `tst.test(...)` call starting on `line` (1-based) of test-chat.cpp."""
    text, starts = _source()
    at = text.index("tst.test(", starts[line - 1]) + len("tst.test(")
    out = []
    while True:
        while text[at].isspace():
            at += 1
        if (m := _RAW.match(text, at)) is not None:
            out.append(m.group(2))
        elif (m := _PLAIN.match(text, at)) is not None:
            out.append(re.sub(r"\\(.)", lambda e: _ESCAPES[e.group(1)], m.group(1)))
        else:
            if text[at] != ")":
                raise ValueError(f"test-chat.cpp:{line}: not a string-literal test input")
            return "".join(out)
        at = m.end()

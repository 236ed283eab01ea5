"""The native kernels' C layout (issue 48): every function a unit exports is declared once, in its header under
kernels/cpu/include (gcc's -Wmissing-prototypes finds one defined without it), and no .c file retypes another
unit's prototype."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from edgeserve.kernels.cpu import native as cpu_native

# a non-static function declaration (not a definition) at the top level of a .c file
PROTOTYPE = re.compile(r"^(?!static\b)[A-Za-z_][\w \*]*\b(qmm_\w+|pool_\w+)\([^;{]*\);", re.M)


def _prototypes(text: str) -> list[str]:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return PROTOTYPE.findall(text)


def test_no_c_file_retypes_a_prototype():
    found = {p.relative_to(cpu_native.CPU_DIR).as_posix(): _prototypes(p.read_text()) for p in cpu_native.SOURCES}
    assert not {k: v for k, v in found.items() if v}


def test_the_prototype_check_sees_one():
    assert _prototypes("/* x */\nvoid qmm_matmul(int fmt,\n   int n);\nstatic void f(void);\nint qmm_x(void) {\n") == \
        ["qmm_matmul"]


@pytest.mark.skipif(cpu_native.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("variant", sorted(set(cpu_native.compilable_variants())))
def test_every_exported_function_has_its_header(variant, tmp_path):
    done = subprocess.run([cpu_native.compiler(), "-fsyntax-only", "-std=gnu11", f"-I{cpu_native.INCLUDE}",
                           "-Werror=missing-prototypes", *cpu_native.VARIANT_FLAGS[variant],
                           *map(str, cpu_native.SOURCES)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_the_build_reads_every_unit_and_header():
    src, inc = cpu_native.CPU_DIR / "src", cpu_native.INCLUDE
    assert set(cpu_native.SOURCES) == set(src.rglob("*.c")) and len(cpu_native.SOURCES) > 10
    assert set(inc.rglob("*.h")) | set(src.rglob("*.h")) == set(cpu_native.HEADERS)

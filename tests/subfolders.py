"""The tests mirror the package in subfolders (tests/engine, tests/models, ...) while their shared helpers stay in
tests/; importing this module puts tests/ and every subfolder on sys.path, so that a test, a helper here or a
benchmark imports another test module's helpers by module name (`from test_gpt_oss import ...`), wherever it lives."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SUBFOLDERS = ("bench", "cluster", "engine", "engine/cache", "engine/sched", "engine/runner", "engine/spec", "kernels",
              "loaders", "models", "offload", "registry", "server", "text", "vision")

for _path in (TESTS, *(TESTS / name for name in SUBFOLDERS)):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

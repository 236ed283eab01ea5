"""The CLI starts fast: `--help`, argument errors and bad flag values import no torch (torch and its compiler take
seconds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from edgeserve.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as e:
    status = e.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton", "transformers", "uvicorn"))
print(json.dumps({"status": status, "heavy": heavy}))
"""


@pytest.mark.parametrize("argv, status", [
    (["--help"], 0),
    (["--version"], 0),
    ([], 2),
    (["serve", "--help"], 0),
    (["run", "--help"], 0),
    (["serve", "--port", "x"], 1),
    (["frob"], 1),
    # bad values the commands check themselves, before any model, server or torch
    (["serve", "--keep-alive", "soon"], 1),
    (["serve", "--max-seqs", "0"], 1),
    (["serve", "--quantize-group-size", "48"], 1),
    (["run", "--top-p", "0", "hi"], 1),
    (["run", "--kv-offload", "gpu", "hi"], 1),
    (["bench", "--url", "http://127.0.0.1:9", "--num-requests", "0"], 1),
])
def test_help_and_argument_errors_import_no_torch(argv, status):
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["status"] == status, proc.stderr
    assert out["heavy"] == [], f"edgeserve {' '.join(argv)} imported {out['heavy'][:5]}"

"""What a new user meets first: --version, bare `edgeserve`, defaults in --help, `list --all`'s columns and kinds,
the LICENSE file, the README's links and the chat page's attach icon."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from edgeserve import __version__
from edgeserve.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_version_and_bare_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"edgeserve {__version__}"
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: edgeserve") and len(err) == 2
    assert err[1].startswith("edgeserve: error:") and "--help" in err[1]


@pytest.mark.parametrize("command, flags", [
    ("run", {"--max-tokens": "256", "--temperature": "0.7", "--top-p": "0.9", "--top-k": "0"}),
    ("serve", {"--port": "8000", "--keep-alive": "5m", "--dtype": "auto", "--log-level": "info",
               "--max-loaded-models": "1"}),
])
def test_help_shows_defaults(command, flags, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare on single spaces
    for flag, default in flags.items():
        m = re.search(re.escape(flag) + r" [A-Z_|{},a-z0-9]+ (.*?)(?= --|$)", text)
        assert m and f"default: {default}" in m.group(1), (flag, m and m.group(1))


def test_list_all_marks_base_models_and_aligns_columns(capsys):
    assert main(["list", "--all"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert header == ["NAME", "KIND", "SIZE", "LICENSE", "WHERE"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows["gemma3-270m"].split()[1] == "base" and rows["smollm2-135m"].split()[1] == "chat"
    assert rows["all-minilm"].split()[1] == "embedding" and rows["bge-reranker-v2-m3"].split()[1] == "rerank"
    # every column starts where the header's does: KIND, LICENSE and WHERE left-aligned, SIZE right-aligned
    for word in ("KIND", "LICENSE", "WHERE"):
        col = lines[0].index(word)
        assert all(line[col - 2:col] == "  " and line[col] != " " for line in lines[1:]), word
    size_end = lines[0].index("SIZE") + len("SIZE")
    assert all(line[size_end - 2:size_end] == "MB" for line in lines[1:])


def test_license_file_is_the_apache_2_text():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    license_field = meta.get("license")
    assert "Apache-2.0" in str(license_field)
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 10_000


def test_readme_links_stay_inside_the_repository():
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)", readme):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        assert (ROOT / target).exists(), f"README links to {target}, not in the repository"
    for path in re.findall(r"`(\.\./[^`]+)`", readme):  # a path outside the clone, even unlinked
        pytest.fail(f"README points at {path}, outside the repository")


def test_chat_page_attach_button_is_an_inline_svg():
    html = (ROOT / "edgeserve" / "server" / "static" / "chat.html").read_text()
    m = re.search(r"<button[^>]*id=\"attach\"[^>]*>(.*?)</button>", html, re.S)
    assert m, "the attach button"
    inner = m.group(1)
    assert "<svg" in inner and not re.search(r"[\U0001F300-\U0001FAFF]|&#x1F", inner)


def test_a_closed_stdout_is_a_quiet_exit():
    """`edgeserve list | head`: the reader closing the pipe is no error."""
    import subprocess
    import sys

    code = ("import sys\nfrom edgeserve.errors import run_reporting_errors\n"
            "def f():\n    raise BrokenPipeError(32, 'Broken pipe')\n"
            "sys.exit(run_reporting_errors('edgeserve', f))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == ""


def test_readme_first_run_installs_cpu_torch_before_the_package():
    """Typed in order, First run installs the CPU build of torch (where there is no NVIDIA GPU) before anything that
    would pull the CUDA build; CI's grep still finds the test command line."""
    readme = (ROOT / "README.md").read_text()
    first_run = readme.split("## First run", 1)[1].split("\n## ", 1)[0]
    installs = [line for line in first_run.splitlines() if line.startswith("python -m pip install")]
    assert installs and "download.pytorch.org/whl/cpu" in installs[0] and "-e ." not in installs[0], installs
    assert any("-e ." in line for line in installs[1:])
    ci = [line for line in readme.splitlines()
          if re.match(r"^python -m pip install .*\[test\].*&& python -m pytest", line)]
    assert ci and ci[0] == 'python -m pip install -q torch==2.13.0 -e ".[test]" && python -m pytest -q'

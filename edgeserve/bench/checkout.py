"""Another commit of this repository, importable beside this one: a temporary git worktree of the commit with the
subpackages that pyproject maps from other folders (edgeserve.kernels = kernels/, ...) linked into place, so that
PYTHONPATH=<worktree> imports that commit's code only (and its native library is built from that commit's C); and
a command run in such trees in alternation."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import tomllib
from pathlib import Path
from typing import Callable


def link_package_dirs(tree: Path) -> None:
    """Link every `package-dir` of tree's pyproject where its dotted name would be imported from (the editable
    install would otherwise answer for it, i.e. this checkout)."""
    package_dirs = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dirs.items():
        target = tree / package.replace(".", "/")
        if package and not target.exists():
            target.symlink_to(tree / folder, target_is_directory=True)


def worktree(rev: str, repo: Path) -> Path:
    """`rev` of the repository at `repo`, checked out (detached) into a new temporary folder, links made."""
    dest = Path(tempfile.mkdtemp(prefix=f"edgeserve-{rev.replace('/', '_').replace('~', '-')}-"))
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "--force", str(dest), rev],
                   check=True, capture_output=True)
    link_package_dirs(dest)
    return dest


def remove_worktree(tree: Path, repo: Path) -> None:
    """Undo `worktree` (the folder and git's record of it)."""
    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False,
                   capture_output=True)


def short_commit(rev: str, repo: Path) -> str:
    """The abbreviated commit id `rev` names."""
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", rev], check=True, capture_output=True,
                          text=True).stdout.strip()


def alternate_trees(trees: dict[str, Path], cmd: list[str], rounds: int,
                    show: Callable[[int, str, dict], None] | None = None) -> dict[str, list[dict]]:
    """Run `cmd` once per tree per round, each run importing that tree only (PYTHONPATH), the order reversed every
    other round (A/B, B/A, ...) so that machine drift hits every side alike; per tree, each run's last stdout line
    as JSON. `show(round, name, result)` is called after each run."""
    results: dict[str, list[dict]] = {name: [] for name in trees}
    names = list(trees)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            env = dict(os.environ, PYTHONPATH=str(trees[name]))
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
            if show:
                show(r + 1, name, results[name][-1])
    return results

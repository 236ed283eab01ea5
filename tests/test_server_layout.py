"""The server's shape (issue 34): its modules import each other without a cycle, every function stays under 60
lines, and the generation routes go through the one pipeline (edgeserve/server/respond.py)."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[1] / "edgeserve" / "server"
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(SERVER.rglob("*.py")):
        rel = path.relative_to(SERVER).with_suffix("").as_posix().replace("/", ".")
        out["edgeserve.server" + ("" if rel == "__init__" else "." + rel.removesuffix(".__init__"))] = \
            ast.parse(path.read_text(encoding="utf-8"))
    return out


def _top_level_imports(tree: ast.Module) -> set[str]:
    """Modules imported when the module loads (not inside functions, not under `if TYPE_CHECKING`)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_server_modules_import_without_a_cycle():
    modules = _modules()
    graph = {m: {n for n in _top_level_imports(t) if n in modules and n != m} for m, t in modules.items()}
    graph["edgeserve.server"] = set()  # the package's __init__ re-exports create_app; its users import it first
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in graph[m]:
            assert state.get(n) != 1, f"import cycle: {' -> '.join([*path, m, n])}"
            if n not in state:
                visit(n, [*path, m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_every_server_function_is_short():
    long = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines >= MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, long


def test_generation_routes_go_through_the_pipeline():
    """Only respond.py builds streaming responses or answers 499; the API adapters call respond()."""
    for name, tree in _modules().items():
        source = ast.unparse(tree)
        if name != "edgeserve.server.respond":
            assert "EventSourceResponse" not in source and "status_code=499" not in source, name
        if name in ("edgeserve.server.api.openai", "edgeserve.server.api.ollama", "edgeserve.server.api.anthropic",
                    "edgeserve.server.api.responses"):
            assert "respond(request, req," in source, name

"""The server's shape (issue 34): its modules import each other without a cycle, every function stays under 60
lines, and the generation routes go through the one pipeline (edgeserve/server/respond.py). The models' shape
(issue 48): no import cycle in edgeserve/models, engine, kernels, offload and loaders, counting the imports inside
functions too; the engine in wings (cache/, sched/, runner/, spec/) that import downwards, beside its entry modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "edgeserve" / "server"
MODELS = SERVER.parent / "models"
# the packages whose modules must not import each other in a circle, lazy imports included (kernels/, loaders/ and
# offload/ install as edgeserve.kernels, .loaders, .offload)
ACYCLIC = {"edgeserve.models": MODELS, "edgeserve.engine": SERVER.parent / "engine", "edgeserve.kernels":
           ROOT / "kernels", "edgeserve.offload": ROOT / "offload", "edgeserve.loaders": ROOT / "loaders"}
MAX_FUNCTION_LINES = 60


def _modules(root: Path = SERVER, package: str = "edgeserve.server") -> dict[str, ast.Module]:
    """Every module under `root` by its dotted name (a package by its own name, not `.__init__`)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
        rel = "" if rel == "__init__" else rel.removesuffix(".__init__")
        out[package + ("." + rel if rel else "")] = ast.parse(path.read_text(encoding="utf-8"))
    return out


def _all_imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Modules `module` imports anywhere it runs, inside functions too (not under `if TYPE_CHECKING`, which never
    runs), relative imports resolved (`from X import y` also names X.y, which may be a module)."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    names: set[str] = set()
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                 and node.test.id == "TYPE_CHECKING" for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    """Fail naming the cycle where `graph` (module -> modules it imports) has one."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, f"import cycle: {' -> '.join([*path, m, n])}"
            if n not in state:
                visit(n, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


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
    _assert_acyclic(graph)


def _package_graph(package: str = "edgeserve.models") -> dict[str, set[str]]:
    """`package`'s modules -> the modules of the same package each imports anywhere it runs."""
    root = ACYCLIC[package]
    modules = _modules(root, package)
    packages = {m for m in modules if (root / Path(*m.split(".")[2:]) / "__init__.py").is_file()}
    return {m: {n for n in _all_imports(t, m, m in packages) if n in modules and n != m} for m, t in modules.items()}


def _models_graph() -> dict[str, set[str]]:
    return _package_graph("edgeserve.models")


@pytest.mark.parametrize("package", sorted(ACYCLIC))
def test_packages_import_without_a_cycle_lazy_imports_included(package):
    """The registry finds architecture packages by name (importlib), so config.py reads no package it is read by;
    the engine's KV formats, pools and window pools, the kernels' decoders and the offload tiers import downwards."""
    _assert_acyclic(_package_graph(package))


def test_the_models_cycle_check_sees_a_lazy_import():
    graph = _models_graph()
    assert "edgeserve.models.encoders.decoder_embed" in graph["edgeserve.models.encoders.embedders"]  # imported inside a function
    assert "edgeserve.models.config" in graph["edgeserve.models.archs.gemma4.config"]
    graph["edgeserve.models.config"].add("edgeserve.models.archs.gemma4.config")  # as before the registry
    try:
        _assert_acyclic(graph)
    except AssertionError as e:
        assert "import cycle" in str(e)
    else:
        raise AssertionError("a cycle through a function-level import went unseen")


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


# what kernels/ may import of the rest of edgeserve: the errors, and the leaf module naming edgeserve's folder
# (the native libraries are cached under it)
KERNELS_MAY_IMPORT = {"edgeserve.errors", "edgeserve.registry.paths"}


def _outside_imports(package: str, prefix: str = "edgeserve.") -> dict[str, set[str]]:
    """`package`'s modules -> the edgeserve modules outside `package` each imports anywhere it runs."""
    root = ACYCLIC[package]
    modules = _modules(root, package)
    packages = {m for m in modules if (root / Path(*m.split(".")[2:]) / "__init__.py").is_file()}
    out = {}
    for m, t in modules.items():
        names = {n for n in _all_imports(t, m, m in packages) if n.startswith(prefix) and n != package
                 and not n.startswith(package + ".")}
        # `from edgeserve.errors import X` also names edgeserve.errors.X: keep the module
        out[m] = {n for n in names if not any(n.startswith(k + ".") for k in names)}
    return out


def test_kernels_know_no_model_engine_or_loader():
    """Kernels import nothing of edgeserve but the errors (and the folder they cache builds in)."""
    bad = {m: names - KERNELS_MAY_IMPORT for m, names in _outside_imports("edgeserve.kernels").items()}
    assert not {m: n for m, n in bad.items() if n}, bad


def _architecture_stems() -> set[str]:
    """The words that name a registered architecture or its family ("gemma" for gemma4, "gpt" for gpt-oss)."""
    from edgeserve.models.registry import ARCHITECTURES

    return {re.match(r"[a-z]+", n.lower()).group(0) for a in ARCHITECTURES for n in (a.name, a.package)}


def _words(name: str) -> set[str]:
    """The lower-case words of an identifier or file name (snake_case, CamelCase and digits split)."""
    return {w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", name)}


_NAME_FIELD = {ast.FunctionDef: "name", ast.AsyncFunctionDef: "name", ast.ClassDef: "name", ast.Name: "id",
               ast.Attribute: "attr", ast.arg: "arg", ast.keyword: "arg", ast.alias: "asname"}


def _code_names(path: Path) -> set[str]:
    """The names a Python or C file defines and uses (not its comments, docstrings or string literals)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        nodes = ast.walk(ast.parse(text))
        names = {getattr(n, _NAME_FIELD[type(n)]) for n in nodes if type(n) in _NAME_FIELD}
        return {n for n in names if n}
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
    return set(re.findall(r"[A-Za-z_]\w*", re.sub(r'"(\\.|[^"\\])*"', " ", text)))


def _architecture_names_in(root: Path) -> list[str]:
    """`path: names` of each kernels file whose path or code names an architecture."""
    stems = _architecture_stems()
    out = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".py", ".c", ".h") or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(root)
        names = {p for p in rel.with_suffix("").parts} | _code_names(path)
        bad = sorted(n for n in names if any(w.startswith(s) for w in _words(n) for s in stems))
        if bad:
            out.append(f"{rel.as_posix()}: {bad}")
    return out


def test_kernels_name_no_architecture():
    """No kernels module, C file or name in their code names a model: a model's plan lives in its package
    (edgeserve/models/archs/<name>/native_plan.py), the kernels offer options by what they do."""
    assert not _architecture_names_in(ROOT / "kernels")


def test_the_architecture_name_check_sees_a_model(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "decoder_gemma4.py").write_text("x = 1\n")
    (tmp_path / "plain.py").write_text("def build_qwen35(m):\n    return m.qwen_gate  # a comment: Llama\n")
    (tmp_path / "cpu" / "layer.c").write_text("/* Gemma 4 */\nint gptoss_sinks; int window;\n")
    (tmp_path / "cpu" / "ok.c").write_text("/* Gemma 4's option */ int sinks; const char *s = \"qwen\";\n")
    assert _architecture_names_in(tmp_path) == ["cpu/layer.c: ['gptoss_sinks']", "decoder_gemma4.py: ['decoder_gemma4']",
                                                "plain.py: ['build_qwen35', 'qwen_gate']"]


def test_the_engine_imports_no_server():
    server = {m: {n for n in names if n.startswith("edgeserve.server")}
              for m, names in _outside_imports("edgeserve.engine").items()}
    assert not {m: n for m, n in server.items() if n}, server



# the engine's wings (issue 48): each may import only the wings listed (speculation sits on all three); the top level
# of edgeserve/engine holds only the public entry modules and the wings
ENGINE = ACYCLIC["edgeserve.engine"]
WING_MAY_IMPORT = {"cache": set(), "sched": {"cache"}, "runner": {"cache", "sched"},
                   "spec": {"cache", "sched", "runner"}}
ENGINE_TOP = {"__init__.py", "core.py", "async_engine.py", "config.py", "outputs.py", "delivery.py", *WING_MAY_IMPORT}


def _engine_top_level(root: Path = ENGINE) -> set[str]:
    """The modules and packages directly under `root` (edgeserve/engine)."""
    return {p.name for p in root.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}


def _wing_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The engine's module graph with each wing collapsed to one node (`cache`, ...), each top-level module its own
    (`core`, `config`, ...)."""
    def node(m: str) -> str:
        return m.split(".")[2] if m.count(".") >= 2 else "__init__"

    out: dict[str, set[str]] = {}
    for m, names in graph.items():
        out.setdefault(node(m), set()).update(node(n) for n in names if node(n) != node(m))
    return out


def _wing_errors(graph: dict[str, set[str]]) -> list[str]:
    """`wing -> wing` edges that WING_MAY_IMPORT does not allow."""
    wings = _wing_graph(graph)
    return sorted(f"{w} -> {n}" for w, allowed in WING_MAY_IMPORT.items() for n in wings.get(w, set())
                  if n in WING_MAY_IMPORT and n not in allowed)


def test_engine_top_level_holds_only_the_entry_modules_and_the_wings():
    """A new engine module goes into its wing (cache/, sched/, runner/, spec/), not flat beside core.py."""
    assert _engine_top_level() == ENGINE_TOP, sorted(_engine_top_level() ^ ENGINE_TOP)


def test_the_engine_top_level_check_sees_a_flat_module(tmp_path):
    for name in ENGINE_TOP - set(WING_MAY_IMPORT):
        (tmp_path / name).write_text("")
    for name in WING_MAY_IMPORT:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "__pycache__").mkdir()  # not a package
    assert _engine_top_level(tmp_path) == ENGINE_TOP
    (tmp_path / "kv_cache.py").write_text("")
    assert _engine_top_level(tmp_path) - ENGINE_TOP == {"kv_cache.py"}


def test_engine_wings_import_downwards_without_a_cycle():
    """cache imports no other wing, sched only cache, runner cache and sched; with each wing one node and each
    top-level module its own, there is no cycle (a wing importing config, which imports the scheduler, would be one)."""
    graph = _package_graph("edgeserve.engine")
    assert not _wing_errors(graph)
    _assert_acyclic(_wing_graph(graph))


def test_the_wing_check_sees_an_upward_import_and_a_cycle_through_the_top_level():
    graph = _package_graph("edgeserve.engine")
    graph["edgeserve.engine.cache.kv_blocks"].add("edgeserve.engine.sched.request_state")  # as before the wings
    assert _wing_errors(graph) == ["cache -> sched"]
    graph = _package_graph("edgeserve.engine")
    graph["edgeserve.engine.cache.kv_format"].add("edgeserve.engine.config")  # config imports the scheduler
    with pytest.raises(AssertionError, match="import cycle"):
        _assert_acyclic(_wing_graph(graph))


# functions allowed over MAX_FUNCTION_LINES outside the server: native bindings and kernels, whose length is one
# table or one kernel body (issue 48 allows a named list of kernels)
LONG_KERNELS = {"kernels/triton/prefill_attention.py:_prefill_kernel"}


def _long_functions(roots: tuple[str, ...] = ("edgeserve", "kernels", "loaders", "offload")) -> list[str]:
    """`path:name (lines)` of every function over MAX_FUNCTION_LINES under `roots`."""
    out = []
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        out.append(f"{path.relative_to(ROOT).as_posix()}:{node.name} ({lines})")
    return out


def test_no_long_function_outside_the_kernel_list():
    """Every product function is at most 60 lines, but the named kernels."""
    long = [f for f in _long_functions() if f.rsplit(" (", 1)[0] not in LONG_KERNELS]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_function_length_check_sees_a_long_function(tmp_path, monkeypatch):
    pkg = tmp_path / "edgeserve"
    pkg.mkdir()
    (pkg / "x.py").write_text("def f():\n" + "    x = 1\n" * 70)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _long_functions(("edgeserve",)) == ["edgeserve/x.py:f (71)"]

"""The package reads bottom-up: core → strategies and clients → the façade → application → command line.

Every module's imports are checked from its source: a module imports only its own layer and the
layers below, and imports at module level (a function-local import hides a cycle), except for the
optional heavy dependencies that a process may never need (torch for the quadratic task, matplotlib
for figures, torchvision's downloader, Ray through ``flwr.simulation``). Also: no module is longer
than about 400 lines.

The façade (``fl_rescaled/__init__.py``) imports the core and the strategies, so it is a layer of
its own between them and the application: ``from fl_rescaled import X`` in a core or strategy
module is an import from above (a cycle through ``__init__``), however the name got there.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT
SOURCES = {"fl_rescaled": ROOT / "fl_rescaled", "fl_rescaled.strategies": ROOT / "strategies",
           "fl_rescaled.clients": ROOT / "clients"}

CORE = {"clock", "privacy", "errors", "timeline", "layout", "matching", "messages", "stepsizes", "manager", "grid", "grid_api",
        "grid_batch", "batching", "torch_batch", "inprocess", "tasks", "data",
        "codec", "reporting", "runstate", "driver", "run_api", "algorithm", "settings", "delays", "speeds", "availability",
        "traces",
        "metrics", "checkpoints", "bounds", "peer_bounds", "divergence", "failures", "matching"}
APPLICATION = {"runspec", "experiment", "flower_sim", "server_app", "paper", "population"}
RANK = {"core": 0, "strategies": 1, "clients": 1, "facade": 1.5, "application": 2, "cli": 3}
LAZY_OK = ("dp_accounting", "torch", "torchvision", "matplotlib", "flwr.simulation")
MAX_LINES = 400


def layer(module: str) -> str | None:
    """The layer of a module of this project (None: not ours)."""
    parts = module.split(".")
    if parts[0] != "fl_rescaled":
        return None
    if len(parts) == 1:
        return "facade"
    top = parts[1]
    if top in CORE:
        return "core"
    if top in ("strategies", "clients"):
        return top
    if top in APPLICATION:
        return "application"
    if top == "cli":
        return "cli"
    raise AssertionError(f"module {module} is in no layer: add it to CORE or APPLICATION in this test")


def modules():
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            name = ".".join((package, *rel))
            if package == "fl_rescaled" and rel and rel[0] in ("strategies", "clients"):
                continue
            yield name, path, path.name == "__init__.py"


def imports(name: str, path: Path, is_package: bool):
    """(imported module, line, inside a function?) of every import in the file."""
    tree = ast.parse(path.read_text())
    here = name if is_package else name.rsplit(".", 1)[0]
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    local = {id(sub) for f in functions for sub in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here.split(".")
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base)
                module = f"{prefix}.{node.module}" if node.module else prefix
            else:
                module = node.module or ""
            # ``from pkg import sub`` may import a submodule: count pkg.sub when it is ours.
            targets = [f"{module}.{a.name}" if (module.startswith("fl_rescaled") and
                                                 _is_module(f"{module}.{a.name}")) else module for a in node.names]
        else:
            continue
        for target in targets:
            yield target, node.lineno, id(node) in local


def _is_module(name: str) -> bool:
    parts = name.split(".")
    for package, folder in SOURCES.items():
        pparts = package.split(".")
        if parts[: len(pparts)] == pparts:
            rest = parts[len(pparts):]
            if rest and ((folder.joinpath(*rest).with_suffix(".py")).exists() or folder.joinpath(*rest).is_dir()):
                if package == "fl_rescaled" and rest[0] in ("strategies", "clients"):
                    continue
                return True
    return False


ALL = list(modules())


@pytest.mark.parametrize("name,path,is_package", ALL, ids=[m[0] for m in ALL])
def test_imports_go_down_the_layers_at_module_level(name, path, is_package):
    mine = layer(name)
    for target, line, in_function in imports(name, path, is_package):
        where = f"{path.relative_to(ROOT)}:{line} imports {target}"
        if in_function:
            assert target.startswith(LAZY_OK), f"{where} inside a function"
        theirs = layer(target)
        if theirs is None:
            continue
        if mine == "facade":
            assert theirs in ("facade", "core", "strategies", "clients"), where
        assert RANK[theirs] <= RANK[mine], f"{where}: {mine} must not import {theirs}"
        if {mine, theirs} == {"strategies", "clients"}:
            raise AssertionError(f"{where}: strategies and clients are independent")


@pytest.mark.parametrize("name,path,is_package", ALL, ids=[m[0] for m in ALL])
def test_modules_are_short(name, path, is_package):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines"


def _graph() -> dict[str, set[str]]:
    """module → the modules of this project it imports at module level (a package's import of one of
    its own submodules included, and the packages a submodule import runs first; ``if TYPE_CHECKING:``
    imports too: they are a circle all the same)."""
    known = {name for name, _, _ in ALL}
    graph: dict[str, set[str]] = {}
    for name, path, is_package in ALL:
        out = set()
        for target, _, in_function in imports(name, path, is_package):
            while target and target not in known:
                target = target.rpartition(".")[0]
            if not target or target == name or in_function:
                continue
            out.add(target)
            # Importing a.b.c first runs the packages a.b (unless the importer is inside a.b: then it runs already).
            package = target.rpartition(".")[0]
            while package in known and not (name == package or name.startswith(package + ".")):
                out.add(package)
                package = package.rpartition(".")[0]
        graph[name] = out
    return graph


def test_no_module_imports_one_that_imports_it_back():
    """No import circle, however long: the modules form a directed acyclic graph. (A package's
    ``__init__`` importing its submodules is an edge like any other, so a submodule must not import
    its own package.)"""
    graph, state, path = _graph(), {}, []

    def visit(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for nxt in sorted(graph.get(module, ())):
            if state.get(nxt) == "open":
                raise AssertionError("import circle: " + " → ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_every_public_class_says_what_it_is():
    """Every public class of the package has a docstring (what it is, in one line at least)."""
    bare = []
    for _, path, _ in ALL:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and ast.get_docstring(node) is None:
                bare.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not bare, bare


#: Where a branch may depend on the kind of clock outside the completion sources (``manager/virtual.py``,
#: ``manager/wall.py``) and the clocks themselves (``clock.py``): the manager's one choice of source,
#: and the experiment runner's emulated compute times (clients sleep τ_i on the wall clock only).
CLOCK_DECISIONS = {"fl_rescaled/manager/manager.py": 1, "fl_rescaled/experiment.py": 1}
CLOCK_KINDS = {"VirtualClock", "WallClock", "VirtualSource", "WallSource"}


def _decides_the_clock(test: ast.AST) -> bool:
    """Whether a condition reads the kind of clock: ``x.virtual``, or ``isinstance(x, <a clock or source>)``."""
    for node in ast.walk(test):
        if isinstance(node, ast.Attribute) and node.attr == "virtual":
            return True
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance" and len(node.args) == 2:
            if {getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node.args[1])} & CLOCK_KINDS:
                return True
    return False


def test_the_clock_is_decided_by_its_completion_source():
    """Counted from the source: every ``if``, conditional expression, ``while`` and comprehension
    filter whose condition reads the kind of clock, outside the sources and ``clock.py``."""
    found: dict[str, int] = {}
    for _, path, _ in ALL:
        rel = str(path.relative_to(ROOT))
        if rel in ("fl_rescaled/manager/virtual.py", "fl_rescaled/manager/wall.py", "fl_rescaled/clock.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            tests = [node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While)) else \
                list(node.ifs) if isinstance(node, ast.comprehension) else []
            found[rel] = found.get(rel, 0) + sum(map(_decides_the_clock, tests))
    assert {k: v for k, v in found.items() if v} == CLOCK_DECISIONS

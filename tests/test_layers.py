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

CORE = {"clock", "errors", "timeline", "layout", "matching", "messages", "stepsizes", "manager", "grid", "grid_api", "grid_batch", "batching", "torch_batch", "inprocess", "tasks", "data",
        "codec", "reporting", "runstate", "driver", "algorithm", "settings", "delays", "speeds", "availability",
        "traces",
        "metrics", "checkpoints", "bounds", "peer_bounds", "divergence", "failures", "matching"}
APPLICATION = {"runspec", "experiment", "flower_sim", "server_app", "paper", "population"}
RANK = {"core": 0, "strategies": 1, "clients": 1, "facade": 1.5, "application": 2, "cli": 3}
LAZY_OK = ("torch", "torchvision", "matplotlib", "flwr.simulation")
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

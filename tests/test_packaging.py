"""What ``pip install`` puts on a user's import path is ``fl_rescaled`` alone: the repository's
top-level ``strategies/`` and ``clients/`` are installed inside it, and nothing named ``strategies``,
``clients`` or ``run_sim`` can shadow a user's own modules."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT


def source_packages() -> set[str]:
    """Every package of the source tree, by the name it has once installed."""
    names = {"fl_rescaled"}
    for top, installed in (("fl_rescaled", "fl_rescaled"), ("strategies", "fl_rescaled.strategies"),
                           ("clients", "fl_rescaled.clients")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            names.add(".".join((installed, *rel)))
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a clean copy of the source tree (no stale build/ folder)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for item in ("pyproject.toml", "README.md", "fl_rescaled", "strategies", "clients"):
        path = ROOT / item
        if path.is_dir():
            shutil.copytree(path, src / item, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / item)
    try:
        import setuptools  # noqa: F401  (build with the environment's setuptools: no download)

        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(out), str(src)],
                   check=True, capture_output=True, text=True, timeout=300)
    return next(out.glob("fl_rescaled-*.whl"))


def test_the_wheel_holds_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"fl_rescaled"}
    packaged = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packaged == source_packages()  # no package of the source tree left out of pyproject.toml
    for path in ("fl_rescaled/strategies/rescaled.py", "fl_rescaled/clients/client_app.py", "fl_rescaled/cli.py"):
        assert path in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "fl-rescaled-sim = fl_rescaled.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_installed_package_imports_without_the_source_tree(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    probe = (
        "import importlib, importlib.util, fl_rescaled, fl_rescaled.strategies, fl_rescaled.clients.client_app as c\n"
        f"[importlib.import_module(m) for m in {sorted(source_packages())!r}]\n"
        "print(fl_rescaled.__file__); print(fl_rescaled.strategies.__file__); print(c.__file__)\n"
        "print([m for m in ('strategies', 'clients', 'run_sim') if importlib.util.find_spec(m)])\n"
        "from fl_rescaled import RescaledASGD, FedAsync, FedBuff, run_inprocess; print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    res = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert all(line.startswith(str(site)) for line in lines[:3]), lines
    assert lines[3] == "[]" and lines[4] == "ok"

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


# A FedAvg-style numpy ClientApp on two nodes (targets 4 and -3, equal curvature, τ = 1 and 2), run in
# the light environment: Rescaled ASGD with model replies lands on the equal-weight point 1/2, FedBuff
# between the two targets. Nothing here may import torch, torchvision, matplotlib or Ray.
LIGHT_PROBE = '''
import importlib.metadata as md, importlib.util, re, sys
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import fl_rescaled
from fl_rescaled import FedBuff, InProcessGrid, RescaledASGD

base = sorted(re.split(r"[ <>=!~;\\[]", r, maxsplit=1)[0].lower() for r in md.requires("fl-rescaled")
              if "extra ==" not in r)
print("base", ",".join(base))
print("absent", ",".join(m for m in ("torch", "torchvision", "matplotlib", "ray") if importlib.util.find_spec(m) is None))
print("data", fl_rescaled.data.load_mnist.__name__)

app = ClientApp()
TARGET = (4.0, -3.0)

@app.train()
def train(msg: Message, context: Context) -> Message:
    w = msg.content["arrays"]["w"].numpy().astype(np.float64)
    target = TARGET[int(context.node_config["partition-id"])]
    for _ in range(3):
        w -= float(msg.content["config"]["lr"]) * 2 * (w - target)
    return Message(RecordDict({"arrays": ArrayRecord({"w": Array(w.astype(np.float32))}),
                               "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

for strategy in (RescaledASGD(reply="model", lr=1.0), FedBuff(buffer_size=2)):  # lr=1: small steps, near the point
    grid = InProcessGrid(app, 2, node_configs=[{"tau": 1.0}, {"tau": 2.0}])
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord({"w": Array(np.zeros(3, np.float32))}),
                            train_config=ConfigRecord({"lr": 0.05}), num_updates=60)
    w = result.arrays["w"].numpy()
    print(type(strategy).__name__, result.books["updates"], result.books["rejected"], float(w.min()), float(w.max()))
print("loaded", ",".join(m for m in ("torch", "torchvision", "matplotlib", "ray", "flwr.simulation") if m in sys.modules))
'''


@pytest.mark.slow
def test_the_base_install_needs_only_flower_and_numpy(wheel, tmp_path):
    """The wheel installed with its base dependencies, from the registry, into a venv that sees none of
    this environment's packages: no torch, torchvision, matplotlib or Ray is installed, and the
    strategies run there on a numpy ClientApp. Most of its time is pip's: 20-25 s on a quiet
    2-core machine, 100 s under a load average of 8 to 12."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)  # no system site packages
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    res = subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check", str(wheel)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    check = subprocess.run([python, "-m", "pip", "check"], env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    res = subprocess.run([python, "-c", "import torch"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0 and "No module named 'torch'" in res.stderr
    res = subprocess.run([python, "-c", LIGHT_PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in res.stdout.splitlines() if " " in line)
    assert out["base"] == "flwr,numpy,rich"  # rich: the progress bar (Flower depends on it too)
    assert out["absent"] == "torch,torchvision,matplotlib,ray"
    assert out["data"] == "load_mnist"
    rescaled = out["RescaledASGD"].split()
    assert rescaled[:2] == ["60", "0"] and abs(float(rescaled[2]) - 0.5) < 0.2 and abs(float(rescaled[3]) - 0.5) < 0.2
    fedbuff = out["FedBuff"].split()
    assert fedbuff[:2] == ["60", "0"] and -3 < float(fedbuff[2]) <= float(fedbuff[3]) < 4
    assert out.get("loaded", "") == ""

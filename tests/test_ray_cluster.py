"""Flower's Simulation Engine on a running two-node Ray cluster (``docs/ray_cluster.md``).

The fast tests check what ``flower_sim.backend_config`` hands ``ray.init``: Ray refuses
``num_cpus``/``num_gpus`` when it joins a running cluster, and without an address it must start a
fresh local instance rather than join whatever ``ray start`` ran last on the machine.

The slow test starts a Ray head and a second node on this machine with ``ray start --block`` (a
scratch ``--temp-dir``, free ports, one CPU each), runs a quadratic experiment on them through
Flower's engine and checks that ClientApp messages were served on both nodes and that the run ends
where the same run ends in process. About 45 s, half of it Ray's start-up.
Teardown signals only the two ``ray start`` processes this test started (each stops its own
node's processes), then their process groups; never ``ray stop``, which stops every Ray process
on the machine.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
from flwr.clientapp import ClientApp

from conftest import TOY1, missing
from fl_rescaled import experiment
from fl_rescaled.clients.client_app import app as project_client_app
from fl_rescaled.flower_sim import backend_config, simulate

RAY = Path(sys.executable).parent / "ray"
SPEC = experiment.RunSpec(task="quadratic", strategy="rescaled", lr=0.01, budget=40.0, **TOY1)


def test_joining_a_cluster_leaves_the_resources_to_its_nodes(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    init = backend_config(3, address="10.0.0.5:6379")["init_args"]
    assert init["address"] == "10.0.0.5:6379"
    assert "num_cpus" not in init and "num_gpus" not in init
    monkeypatch.setenv("RAY_ADDRESS", "ray://10.0.0.5:10001")
    init = backend_config(3)["init_args"]
    assert init["address"] == "ray://10.0.0.5:10001" and "num_cpus" not in init
    assert backend_config(3, address="10.0.0.6:6379")["init_args"]["address"] == "10.0.0.6:6379"


def test_without_an_address_ray_starts_a_fresh_local_instance(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    init = backend_config(3)["init_args"]
    assert init["address"] == "local"  # not the cluster of an earlier `ray start` on this machine
    assert init["num_cpus"] == 3 and init["num_gpus"] == 0
    with pytest.raises(ValueError, match="num_cpus"):
        backend_config(0, address="auto")


class NodeRecordingApp(ClientApp):
    """The project's ClientApp; each message also appends "<Ray node id> <pid>" to ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def __call__(self, message, context):
        import ray

        with open(self.path, "a", encoding="utf-8") as f:
            f.write(f"{ray.get_runtime_context().get_node_id()} {os.getpid()}\n")
        return project_client_app(message, context)


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago (all held open while they are drawn)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def wait_for(predicate, what: str, timeout: float, logs: list[Path], procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            tails = "\n".join(f"--- {p}:\n{p.read_text(errors='replace')[-2000:]}" for p in logs if p.exists())
            pytest.fail(f"{what} within {timeout:.0f} s\n{tails}")
        time.sleep(1.0)


def alive_nodes(address: str, env: dict[str, str]) -> list[str]:
    """The node ids that ``ray status`` lists as active."""
    out = subprocess.run([str(RAY), "status", "--address", address], env=env, capture_output=True, text=True,
                         timeout=60).stdout
    active = out.split("Active:", 1)[-1].split("Pending:", 1)[0] if "Active:" in out else ""
    return re.findall(r"\bnode_([0-9a-f]+)", active)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM a ``ray start --block`` (it stops its node's processes), then SIGKILL its group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group is this node's (start_new_session=True)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def ray_cluster():
    if not RAY.exists():
        missing("ray", f"no ray command next to {sys.executable}")
    temp = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    # fl_rescaled.OFFLINE_ENV sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (Ray on loopback, one node), under
    # which `ray start --address` refuses to add a node: the cluster's processes need it on
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1")
    ports = free_ports(16 + 2 * 20)
    address = f"127.0.0.1:{ports[0]}"
    common = ["--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0", f"--temp-dir={temp}",
              "--object-store-memory=100000000", "--disable-usage-stats"]

    def node_ports(p: list[int], w: list[int]) -> list[str]:
        return [f"--node-manager-port={p[0]}", f"--object-manager-port={p[1]}",
                f"--dashboard-agent-listen-port={p[2]}", f"--dashboard-agent-grpc-port={p[3]}",
                f"--runtime-env-agent-port={p[4]}", f"--metrics-export-port={p[5]}",
                "--worker-port-list=" + ",".join(map(str, w))]

    head_cmd = [str(RAY), "start", "--head", f"--port={ports[0]}", f"--ray-client-server-port={ports[1]}",
                f"--dashboard-port={ports[2]}", "--include-dashboard=false", *common,
                *node_ports(ports[3:9], ports[16:36])]
    node_cmd = [str(RAY), "start", f"--address={address}", *common, *node_ports(ports[9:15], ports[36:56])]
    logs = [temp / "head.log", temp / "node.log"]
    procs: list[subprocess.Popen] = []
    try:
        for cmd, log in zip((head_cmd, node_cmd), logs):
            with open(log, "w", encoding="utf-8") as out:
                procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
            wait_for(lambda log=log: "Ray runtime started" in log.read_text(errors="replace"),
                     f"{log.stem}: ray start did not report the runtime started", 180, logs, procs)
        nodes: list[str] = []

        def both_alive() -> bool:
            nodes[:] = alive_nodes(address, env)
            return len(nodes) == 2

        wait_for(both_alive, "ray status did not list two active nodes", 120, logs, procs)
        yield SimpleNamespace(address=address, node_ids=set(nodes))
    finally:
        import ray

        if ray.is_initialized():  # Flower shuts Ray down after a run; a failed run may not have
            ray.shutdown()
        for proc in reversed(procs):
            stop(proc)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_a_run_on_a_two_node_cluster_uses_both_nodes_and_keeps_its_trajectory(ray_cluster, tmp_path):
    spec = experiment.resolve(SPEC)
    where = tmp_path / "where.txt"
    outcome = simulate(lambda grid, context: experiment.run(spec, grid=grid), num_supernodes=2,
                       client_app=NodeRecordingApp(str(where)), ray_address=ray_cluster.address)
    served = [line.split()[0] for line in where.read_text().splitlines()]
    assert set(served) == ray_cluster.node_ids  # messages ran on the head and on the second node
    assert outcome["books"]["replies-accepted"] <= len(served) <= outcome["books"]["jobs-sent"]

    reference = experiment.run(spec)  # the in-process Grid
    assert outcome["final_params"] == reference["final_params"]
    assert outcome["books"] == reference["books"]
    assert outcome["updates_per_worker"] == reference["updates_per_worker"] == [40, 20]

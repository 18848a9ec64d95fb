"""One SuperLink and N SuperNodes on 127.0.0.1, insecure or with TLS and SuperNode authentication."""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from fl_rescaled import OFFLINE_ENV

from .config import DeployConfig
from .credentials import NodeKey, TlsFiles, write_node_key, write_tls
from .output import NodeEvents
from .processes import Proc, ProcessSet

CONNECTION = "local-deploy"
EXECUTABLES = ("flower-superlink", "flower-supernode", "flwr")
# What the FAB needs: the app's pyproject.toml, README (named by pyproject) and its packages.
APP_ITEMS = ("pyproject.toml", "README.md", ".gitignore", "run_sim.py", "fl_rescaled", "strategies", "clients")
APP_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "results", "runs", "*.npz", "*.whl")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def copy_app(src: Path, dst: Path) -> Path:
    """Copy the app's files needed in the FAB to ``dst`` (the repository is never written)."""
    dst.mkdir(parents=True)
    for name in APP_ITEMS:
        p = src / name
        if p.is_dir():
            shutil.copytree(p, dst / name, ignore=APP_IGNORE)
        elif p.is_file():
            shutil.copy2(p, dst / name)
    if not (dst / "pyproject.toml").is_file():
        raise SystemExit(f"no pyproject.toml in {src}")
    return dst


def write_connection(flwr_home: Path, port: int, ca_cert: Path | None) -> Path:
    """Write ``$FLWR_HOME/config.toml`` with the local SuperLink as the default connection.

    Flower 1.42 reads connections from this file (``flwr/cli/flower_config.py``): a table
    ``[superlink.<name>]`` with ``address`` (Control API, host:port), ``insecure`` (bool) or
    ``root-certificates`` (absolute path), and ``[superlink] default = "<name>"``.
    """
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    security = f'root-certificates = "{ca_cert.resolve()}"\n' if ca_cert else "insecure = true\n"
    path.write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "127.0.0.1:{port}"\n'
        + security,
        encoding="utf-8",
    )
    return path


class LocalDeployment:
    """One SuperLink and N SuperNodes on loopback; ``stop()`` ends everything it started."""

    def __init__(self, config: DeployConfig) -> None:
        self.config = config
        self.bin = config.bin_dir
        for exe in EXECUTABLES:
            if not (self.bin / exe).exists():
                raise SystemExit(f"{exe} not found in {self.bin} (use --bin-dir)")
        self.work = Path(tempfile.mkdtemp(prefix="fl-deploy-", dir=config.tmp_dir))
        self.home = self.work / "home"  # FLWR_HOME of the CLI (config.toml) and of the SuperLink
        self.logs = self.work / "logs"
        self.logs.mkdir()
        self.events = NodeEvents()
        env = {**os.environ, **OFFLINE_ENV, "PYTHONUNBUFFERED": "1", "FLWR_HOME": str(self.home),
               "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("VIRTUAL_ENV_PROMPT", None)
        self.procs = ProcessSet(self.work.name, env, self.work, self.logs, self.events.feed)
        self.nodes: dict[int, Proc] = {}
        self.superlink: Proc | None = None
        self.port = 0
        self.tls: TlsFiles | None = write_tls(self.work / "tls") if config.secure else None
        self.keys: dict[int, NodeKey] = {}
        self.node_ids: dict[int, int] = {}  # partition id -> the node id its key was registered as

    # ---------------------------------------------------------------- SuperLink
    def start_superlink(self) -> None:
        self.port = self.config.port or free_ports(1)[0]
        security = ["--insecure"] if self.tls is None else [
            "--ssl-ca-certfile", str(self.tls.ca_cert), "--ssl-certfile", str(self.tls.server_cert),
            "--ssl-keyfile", str(self.tls.server_key), "--enable-supernode-auth"]
        cmd = [str(self.bin / "flower-superlink"), *security, "--host", "127.0.0.1", "--port", str(self.port),
               "--disable-runtime-dependency-installation"]
        self.superlink = self.procs.spawn("superlink", cmd)
        deadline = time.monotonic() + self.config.startup_timeout
        while not self.health(tls=self.tls is not None):
            if not self.superlink.alive():
                raise RuntimeError(f"flower-superlink exited:\n{self.superlink.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"SuperLink not healthy after {self.config.startup_timeout} s:\n"
                                   f"{self.superlink.tail()}")
            time.sleep(0.2)
        write_connection(self.home, self.port, self.tls.ca_cert if self.tls else None)

    def health(self, *, tls: bool) -> bool:
        """Whether ``GET /health`` answers 200 over https (verified against our CA) or plain http."""
        context = ssl.create_default_context(cafile=str(self.tls.ca_cert)) if tls and self.tls else None
        try:
            with urllib.request.urlopen(f"{'https' if tls else 'http'}://127.0.0.1:{self.port}/health",
                                        timeout=1.0, context=context) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def superlink_log(self) -> str:
        assert self.superlink is not None and self.superlink.logfile is not None
        return self.superlink.logfile.read_text(errors="replace")

    # ---------------------------------------------------------------- the Flower CLI
    def flwr(self, *args: str, timeout: float = 60.0) -> dict[str, Any] | None:
        """Run ``flwr <args> --format json``; its JSON answer, or None if it failed."""
        try:
            res = subprocess.run([str(self.bin / "flwr"), *args, "--format", "json"], env=self.procs.env,
                                 capture_output=True, text=True, timeout=timeout, cwd=self.work)
            data = json.loads(res.stdout)
        except (subprocess.TimeoutExpired, json.JSONDecodeError, OSError):
            return None
        return data if data.get("success") else None

    def list_nodes(self) -> list[dict[str, Any]] | None:
        """The SuperLink's node list (``flwr supernode ls``): node id, status, ..., or None."""
        data = self.flwr("supernode", "ls", CONNECTION)
        return None if data is None else list(data.get("nodes", []))

    def node_status(self, i: int) -> str | None:
        """``--secure``: the status the SuperLink lists for node i's registered id (None if unknown)."""
        nodes = self.list_nodes() or []
        return next((nd.get("status") for nd in nodes if int(nd["node-id"]) == self.node_ids.get(i)), None)

    def register_keys(self) -> dict[int, int]:
        """``--secure``: make node i's key pair and register its public key (``flwr supernode
        register``); returns partition id -> node id."""
        for i in range(self.config.nodes):
            self.keys[i] = write_node_key(self.work / "keys", f"node{i}")
            data = self.flwr("supernode", "register", str(self.keys[i].public), CONNECTION)
            if data is None:
                raise RuntimeError(f"flwr supernode register failed for node {i}")
            self.node_ids[i] = int(data["node-id"])
        return dict(self.node_ids)

    # ---------------------------------------------------------------- SuperNodes
    def start_node(self, i: int) -> Proc:
        """Start SuperNode ``i`` (partition i), with its registered key under ``--secure``."""
        proc = self._start_supernode(f"node{i}", self.config.node_config(i), self.keys.get(i))
        self.nodes[i] = proc
        return proc

    def start_intruder(self, j: int) -> tuple[Proc, NodeKey]:
        """A SuperNode with a fresh key that was never registered, posing as partition j % n."""
        key = write_node_key(self.work / "keys", f"intruder{j}")
        node_config = self.config.node_config(j % self.config.nodes)
        return self._start_supernode(f"intruder{j}", node_config, key), key

    def _start_supernode(self, name: str, node_config: str, key: NodeKey | None) -> Proc:
        if self.tls is None:
            security = ["--insecure"]
        else:
            assert key is not None, "a secure SuperNode needs a key"
            security = ["--root-certificates", str(self.tls.ca_cert),
                        "--auth-supernode-private-key", str(key.private)]
        env = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": str(self.config.task_poll_interval),
               "FLWR_HOME": str(self.work / name)}  # own app store: no two nodes unpack one FAB
        cmd = [str(self.bin / "flower-supernode"), *security, "--superlink", f"127.0.0.1:{self.port}",
               "--node-config", node_config, "--host", "127.0.0.1", "--port", str(free_ports(1)[0])]
        return self.procs.spawn(name, cmd, env=env)

    def wait_nodes(self, expected: int) -> float:
        t0 = time.monotonic()
        deadline = t0 + self.config.startup_timeout
        while True:
            for i, p in self.nodes.items():
                if not p.alive():
                    raise RuntimeError(f"SuperNode {i} exited:\n{p.tail()}")
            nodes = self.list_nodes()
            online = None if nodes is None else sum(1 for nd in nodes if nd.get("status") == "online")
            if online is not None and online >= expected:
                return time.monotonic() - t0
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {online} of {expected} SuperNodes online after "
                                   f"{self.config.startup_timeout} s")
            time.sleep(0.5)

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i`` and everything in its process group (a device that vanishes)."""
        self.nodes[i].kill_group()

    # ---------------------------------------------------------------- the run
    def start_run(self, app: Path, run_config: str) -> tuple[Proc, list[str]]:
        """``flwr run <app> local-deploy --stream [--run-config ...]``; the caller reads its output."""
        cmd = [str(self.bin / "flwr"), "run", str(app), CONNECTION, "--stream"]
        if run_config:
            cmd += ["--run-config", run_config]
        return self.procs.spawn("flwr-run", cmd, capture=True), cmd

    def stop(self) -> list[int]:
        """Stop every process started here; the PIDs still alive afterwards.

        ``flwr run`` first, then the SuperNodes (SIGTERM: they deregister), then the SuperLink.
        """
        return self.procs.stop(first=["flwr-run", "node", "intruder"])

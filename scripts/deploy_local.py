#!/usr/bin/env python3
"""Run the fl-rescaled Flower app on a local deployment: one SuperLink and N SuperNodes.

Everything binds to 127.0.0.1 on free ports and lives in a scratch directory under /tmp
(``FLWR_HOME`` of every process, logs, a copy of the app). The script

1. copies the app (pyproject.toml and the Python packages, no virtualenv, caches or results) to
   the scratch directory, so that ``flwr run`` never touches the repository's pyproject.toml;
2. starts ``flower-superlink --insecure --disable-runtime-dependency-installation`` and waits
   for its ``/health`` endpoint;
3. starts N ``flower-supernode --insecure`` processes, node i with
   ``--node-config "partition-id=i num-partitions=N [tau=τ_i]"`` and its own Runtime API port,
   with ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` lowered (default 0.05 s), and waits until
   ``flwr supernode ls`` reports all N online;
4. writes the connection ``[superlink.local-deploy]`` into ``$FLWR_HOME/config.toml`` and runs
   ``flwr run <app copy> local-deploy --stream --run-config "..."``, echoing its log;
5. optionally SIGKILLs one SuperNode (its whole process group) mid-run, and restarts it later;
6. extracts the ServerApp's ``fl-rescaled result: {json}`` line, prints it and writes it to
   ``--json-out`` (with a ``deployment`` section of timings);
7. on exit, Ctrl-C, SIGTERM or error stops every process it started, by PID: each one's process
   group, then any process that still carries this run's marker in its environment (the
   SuperLink starts its SuperExec in a new session), and checks that none is left.

Example::

    .venv/bin/python scripts/deploy_local.py --nodes 3 --taus 1,2,4 \\
        --run-config "budget=6.0 quad-a='1,1,1' quad-b='0,1,2' lr=0.1"

Exit status: 0 with a result, 1 without one (the run failed), 2 on timeout, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "fl-rescaled result: "
CONNECTION = "local-deploy"
MARKER = "FL_RESCALED_DEPLOY_ID"  # set in every started process's environment (children inherit it)
# What the FAB needs: the app's pyproject.toml, README (named by pyproject) and its packages.
APP_ITEMS = ("pyproject.toml", "README.md", ".gitignore", "run_sim.py", "fl_rescaled", "strategies", "clients")
APP_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "results", "runs", "*.npz", "*.whl")
QUIET_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "PYTHONUNBUFFERED": "1",
}


def log(msg: str) -> None:
    print(f"[deploy {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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


def parse_floats(text: str | None) -> list[float] | None:
    if not text:
        return None
    return [float(v) for v in text.split(",") if v.strip()]


def run_config_keys(run_config: str) -> list[str]:
    """The keys of a ``--run-config "k=v k2='x y'"`` string (best effort; [] if unparsable)."""
    try:
        tokens = shlex.split(run_config, posix=False)
    except ValueError:
        return []
    return [t.split("=", 1)[0].strip() for t in tokens if "=" in t]


def app_config_keys(app: Path) -> set[str]:
    data = tomllib.loads((app / "pyproject.toml").read_text(encoding="utf-8"))
    return set(data.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {}))


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


def write_connection(flwr_home: Path, port: int) -> Path:
    """Write ``$FLWR_HOME/config.toml`` with the local SuperLink as the default connection.

    Flower 1.42 reads connections from this file (``flwr/cli/flower_config.py``): a table
    ``[superlink.<name>]`` with ``address`` (Control API, host:port), ``insecure`` (bool) or
    ``root-certificates`` (absolute path), and ``[superlink] default = "<name>"``.
    """
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    path.write_text(
        "[superlink]\n"
        f'default = "{CONNECTION}"\n\n'
        f"[superlink.{CONNECTION}]\n"
        f'address = "127.0.0.1:{port}"\n'
        "insecure = true\n",
        encoding="utf-8",
    )
    return path


class Proc:
    def __init__(self, name: str, popen: subprocess.Popen, logfile: Path | None) -> None:
        self.name, self.popen, self.logfile = name, popen, logfile

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        if self.logfile is None or not self.logfile.exists():
            return ""
        lines = self.logfile.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


def _marked_pids(tag: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose environment carries ``MARKER=tag``."""
    needle = f"{MARKER}={tag}".encode()
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state != b"Z":
            found.append(int(entry))
    return found


class LocalDeployment:
    """One SuperLink and N SuperNodes on loopback; ``stop()`` ends everything it started."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.bin = Path(args.bin_dir) if args.bin_dir else Path(sys.executable).parent
        for exe in ("flower-superlink", "flower-supernode", "flwr"):
            if not (self.bin / exe).exists():
                raise SystemExit(f"{exe} not found in {self.bin} (use --bin-dir)")
        self.work = Path(tempfile.mkdtemp(prefix="fl-deploy-", dir=args.tmp_dir))
        self.tag = self.work.name
        self.home = self.work / "home"  # FLWR_HOME of the CLI (config.toml) and of the SuperLink
        self.logs = self.work / "logs"
        self.logs.mkdir()
        self.procs: list[Proc] = []
        self.nodes: dict[int, Proc] = {}
        self.superlink: Proc | None = None
        self.port = 0
        self._lock = threading.Lock()
        self._stopped = False
        self.events: dict[str, list[tuple[float, str]]] = {}
        env = dict(os.environ)
        env.update(QUIET_ENV)
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        env[MARKER] = self.tag
        env["FLWR_HOME"] = str(self.home)
        for var in ("VIRTUAL_ENV_PROMPT",):
            env.pop(var, None)
        self.env = env

    # ---------------------------------------------------------------- processes
    def _spawn(self, name: str, cmd: list[str], *, env: dict[str, str] | None = None,
               capture: bool = False) -> Proc:
        """Start ``cmd`` in a new process group (session).

        ``capture``: the caller reads its stdout; otherwise a thread copies it to
        ``logs/<name>.log`` with a wall-clock timestamp per line and feeds ``self.events``.
        """
        logfile = None if capture else self.logs / f"{name}.log"
        with self._lock:
            if self._stopped:
                raise RuntimeError("deployment is stopping")
            popen = subprocess.Popen(
                cmd, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=self.work, start_new_session=True, text=True, bufsize=1,
                errors="replace",
            )
            proc = Proc(name, popen, logfile)
            self.procs.append(proc)
        if not capture:
            threading.Thread(target=self._pump_log, args=(proc,), daemon=True).start()
        return proc

    def _pump_log(self, proc: Proc) -> None:
        assert proc.popen.stdout is not None and proc.logfile is not None
        events = self.events.setdefault(proc.name, [])
        with open(proc.logfile, "a", encoding="utf-8") as f:
            for line in proc.popen.stdout:
                now = time.time()
                f.write(f"{now:.3f} {line}")
                f.flush()
                if "Receiving: train" in line:
                    events.append((now, "recv"))
                elif "Sending: train" in line:
                    events.append((now, "send"))

    def node_stats(self) -> dict[str, Any]:
        """Per node, from its timestamped log: train messages, median time from receiving a
        message to sending its reply (ClientApp process start + compute + emulated τ), and
        median interval between two replies (the node's delivery period)."""
        out: dict[str, Any] = {}
        for name, events in sorted(self.events.items()):
            if not name.startswith("node"):
                continue
            recv = [t for t, kind in events if kind == "recv"]
            send = [t for t, kind in events if kind == "send"]
            inside = [s - r for r, s in zip(recv, send) if s >= r]
            gaps = [b - a for a, b in zip(send, send[1:])]
            out[name] = {
                "train_messages": len(send),
                "median_in_node_s": round(_median(inside), 3) if inside else None,
                "median_reply_interval_s": round(_median(gaps), 3) if gaps else None,
            }
        return out

    def start_superlink(self) -> None:
        self.port = self.args.port or free_ports(1)[0]
        cmd = [str(self.bin / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(self.port),
               "--disable-runtime-dependency-installation"]
        self.superlink = self._spawn("superlink", cmd)
        url = f"http://127.0.0.1:{self.port}/health"
        deadline = time.monotonic() + self.args.startup_timeout
        while True:
            if not self.superlink.alive():
                raise RuntimeError(f"flower-superlink exited:\n{self.superlink.tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"SuperLink not healthy after {self.args.startup_timeout} s:\n"
                                   f"{self.superlink.tail()}")
            time.sleep(0.2)
        write_connection(self.home, self.port)

    def start_node(self, i: int) -> Proc:
        n, taus = self.args.nodes, self.taus
        node_config = f"partition-id={i} num-partitions={n}"
        if taus is not None:
            node_config += f" tau={float(taus[i])!r}"
        port = free_ports(1)[0]
        env = dict(self.env)
        env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(self.args.task_poll_interval)
        env["FLWR_HOME"] = str(self.work / f"node{i}")  # own app store: no two nodes unpack one FAB
        cmd = [str(self.bin / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.port}",
               "--node-config", node_config, "--host", "127.0.0.1", "--port", str(port)]
        proc = self._spawn(f"node{i}", cmd, env=env)
        self.nodes[i] = proc
        return proc

    @property
    def taus(self) -> list[float] | None:
        return parse_floats(self.args.taus)

    def online_nodes(self) -> int | None:
        """How many SuperNodes the SuperLink lists as online (``flwr supernode ls``)."""
        try:
            res = subprocess.run(
                [str(self.bin / "flwr"), "supernode", "ls", CONNECTION, "--format", "json"],
                env=self.env, capture_output=True, text=True, timeout=60, cwd=self.work,
            )
            data = json.loads(res.stdout)
        except (subprocess.TimeoutExpired, json.JSONDecodeError, OSError):
            return None
        if not data.get("success"):
            return None
        return sum(1 for nd in data.get("nodes", []) if nd.get("status") == "online")

    def wait_nodes(self, expected: int) -> float:
        t0 = time.monotonic()
        deadline = t0 + self.args.startup_timeout
        while True:
            for i, p in self.nodes.items():
                if not p.alive():
                    raise RuntimeError(f"SuperNode {i} exited:\n{p.tail()}")
            online = self.online_nodes()
            if online is not None and online >= expected:
                return time.monotonic() - t0
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {online} of {expected} SuperNodes online after "
                                   f"{self.args.startup_timeout} s")
            time.sleep(0.5)

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i`` and everything in its process group (a device that vanishes)."""
        proc = self.nodes[i]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.popen.wait()

    # ---------------------------------------------------------------- shutdown
    def stop(self, grace: float = 5.0) -> list[int]:
        """Stop every process started here, by PID; returns the PIDs still alive afterwards."""
        with self._lock:
            self._stopped = True
            procs = list(self.procs)
        # flwr run first, then the SuperNodes (SIGTERM: they deregister), then the SuperLink.
        order = [p for p in procs if p.name == "flwr-run"] + [p for p in procs if p.name.startswith("node")]
        order += [p for p in procs if p not in order]
        for p in order:
            if p.alive():
                _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in order:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in order:  # the group may hold children even after its leader exited
            _signal_group(p.pid, signal.SIGKILL)
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log(f"{p.name} (pid {p.pid}) did not exit")
        # Processes that left our groups (the SuperLink's SuperExec runs in a new session).
        left = _marked_pids(self.tag)
        for pid in left:
            _signal_pid(pid, signal.SIGTERM)
        t_end = time.monotonic() + grace
        while left and time.monotonic() < t_end:
            time.sleep(0.1)
            left = _marked_pids(self.tag)
        for pid in left:
            _signal_pid(pid, signal.SIGKILL)
        time.sleep(0.2 if left else 0.0)
        return _marked_pids(self.tag)


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    m = len(ys) // 2
    return ys[m] if len(ys) % 2 else 0.5 * (ys[m - 1] + ys[m])


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ResultScanner:
    """Finds ``fl-rescaled result: {json}`` in a log stream (the JSON may span several lines)."""

    def __init__(self) -> None:
        self.result: dict[str, Any] | None = None
        self._buf: str | None = None
        self._lines = 0

    def feed(self, line: str) -> None:
        if self._buf is None:
            k = line.find(RESULT_PREFIX)
            if k < 0:
                return
            self._buf, self._lines = line[k + len(RESULT_PREFIX):].strip(), 0
        else:
            self._buf += line.rstrip("\n")
            self._lines += 1
        start = self._buf.find("{")
        if start < 0:
            return
        try:
            obj, _ = json.JSONDecoder().raw_decode(self._buf[start:])
        except json.JSONDecodeError:
            if self._lines > 200:
                self._buf = None
            return
        self.result, self._buf = obj, None


def build_run_config(args: argparse.Namespace, app: Path) -> str:
    """The ``--run-config`` string, plus ``taus`` from ``--taus``; unknown keys are an error."""
    run_config = args.run_config.strip()
    keys = run_config_keys(run_config)
    if args.taus and "taus" not in keys:
        run_config = f"{run_config} taus='{args.taus}'".strip()
        keys.append("taus")
    known = app_config_keys(app)
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(f"unknown --run-config keys {unknown}: every key must exist in "
                         "[tool.flwr.app.config] of pyproject.toml")
    return run_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=3, help="number of SuperNodes (default 3)")
    p.add_argument("--taus", default="", help="per-node mean compute times, e.g. 1,2,4: passed to each "
                   "SuperNode as node config tau=τ_i and, unless --run-config sets taus, as run config taus")
    p.add_argument("--run-config", default="", help="passed to flwr run --run-config (keys of "
                   "[tool.flwr.app.config])")
    p.add_argument("--app", default=str(ROOT), help="app directory to copy and run (default: the repository)")
    p.add_argument("--port", type=int, default=0, help="SuperLink port (default: a free one)")
    p.add_argument("--task-poll-interval", type=float, default=0.05,
                   help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL for the SuperNodes (default 0.05 s)")
    p.add_argument("--kill-node", type=int, default=None, help="SIGKILL this node (partition id) mid-run")
    p.add_argument("--kill-after", type=float, default=30.0,
                   help="seconds after the run started to kill --kill-node (default 30)")
    p.add_argument("--revive-after", type=float, default=None,
                   help="restart the killed node this many seconds after the kill (new node id)")
    p.add_argument("--json-out", default=None, help="write the result JSON here")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--bin-dir", default=None, help="directory with flwr, flower-superlink, flower-supernode "
                   "(default: that of this Python)")
    p.add_argument("--tmp-dir", default=None, help="parent of the scratch directory (default: system temp)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs, FLWR_HOME)")
    p.add_argument("--quiet", action="store_true", help="do not echo the run's log")
    args = p.parse_args(argv)
    if args.nodes < 1:
        p.error("--nodes must be at least 1")
    taus = parse_floats(args.taus)
    if taus is not None and len(taus) != args.nodes:
        p.error(f"--taus has {len(taus)} values for {args.nodes} nodes")
    if args.kill_node is not None and not 0 <= args.kill_node < args.nodes:
        p.error("--kill-node must be a node index in 0..nodes-1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run_config = build_run_config(args, Path(args.app).resolve())
    except (ValueError, OSError, tomllib.TOMLDecodeError) as err:
        log(f"error: {err}")
        return 1

    def on_term(signum, frame):  # SIGTERM/SIGHUP behave like Ctrl-C: clean up and leave
        raise KeyboardInterrupt

    # SIGINT too: a shell may start a background job with SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_term)
    dep = LocalDeployment(args)
    status = 1
    info: dict[str, Any] = {"nodes": args.nodes, "taus": parse_floats(args.taus), "scratch": str(dep.work)}
    scanner = ResultScanner()
    try:
        t0 = time.monotonic()
        app = copy_app(Path(args.app).resolve(), dep.work / "app")
        dep.start_superlink()
        log(f"SuperLink on 127.0.0.1:{dep.port} (pid {dep.superlink.pid}), scratch {dep.work}")
        for i in range(args.nodes):
            dep.start_node(i)
        info["nodes_ready_seconds"] = round(dep.wait_nodes(args.nodes), 2)
        info["startup_seconds"] = round(time.monotonic() - t0, 2)
        log(f"{args.nodes} SuperNodes online after {info['startup_seconds']:.1f} s "
            f"(pids {[p.pid for p in dep.nodes.values()]})")
        cmd = [str(dep.bin / "flwr"), "run", str(app), CONNECTION, "--stream"]
        if run_config:
            cmd += ["--run-config", run_config]
        log("$ " + shlex.join(cmd[1:]))
        run_log = open(dep.logs / "flwr-run.log", "w", encoding="utf-8")  # noqa: SIM115
        t_run = time.monotonic()
        flwr = dep._spawn("flwr-run", cmd, capture=True)
        started = threading.Event()

        def pump() -> None:
            assert flwr.popen.stdout is not None
            for line in flwr.popen.stdout:
                run_log.write(line)
                run_log.flush()
                if not args.quiet:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                if "Successfully started run" in line:
                    started.set()
                scanner.feed(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        killed_at = revived = None
        while flwr.alive() or reader.is_alive():
            now = time.monotonic()
            if now - t0 > args.timeout:
                log(f"timeout after {args.timeout} s")
                status = 2
                break
            if args.kill_node is not None and killed_at is None and started.is_set() \
                    and now - t_run >= args.kill_after:
                dep.kill_node(args.kill_node)
                killed_at = now
                info["killed_node"] = args.kill_node
                info["killed_at_seconds"] = round(now - t_run, 2)
                log(f"SIGKILLed SuperNode {args.kill_node} at {now - t_run:.1f} s into the run")
            if killed_at is not None and args.revive_after is not None and revived is None \
                    and now - killed_at >= args.revive_after:
                revived = now
                proc = dep.start_node(args.kill_node)
                info["revived_at_seconds"] = round(now - t_run, 2)
                log(f"restarted SuperNode {args.kill_node} (pid {proc.pid})")
            reader.join(timeout=0.2)
        else:
            status = 0 if scanner.result is not None else 1
        info["run_seconds"] = round(time.monotonic() - t_run, 2)
        info["flwr_run_returncode"] = flwr.popen.poll()
        run_log.close()
    except KeyboardInterrupt:
        log("interrupted")
        status = 130
    except (RuntimeError, TimeoutError) as err:
        log(f"error: {err}")
        status = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # let the clean-up finish
            signal.signal(sig, signal.SIG_IGN)
        left = dep.stop()
        if left:
            log(f"processes still alive after cleanup: {left}")
        else:
            log("all processes stopped")
        info["leftover_pids"] = left
        info["superlink_port"] = dep.port
        info["node_stats"] = dep.node_stats()
    if scanner.result is not None:
        result = dict(scanner.result)
        result["deployment"] = info
        text = json.dumps(result, default=float)
        print(RESULT_PREFIX + text, flush=True)
        if args.json_out:
            Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_out).write_text(text + "\n", encoding="utf-8")
    else:
        log(f"no '{RESULT_PREFIX.strip()}' line in the run's log ({dep.logs / 'flwr-run.log'})")
        if status == 0:
            status = 1
    if args.keep or status != 0:
        log(f"logs kept in {dep.logs}")
    else:
        shutil.rmtree(dep.work, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

"""One deployment from start to report: start the processes, follow the run, stop, report."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

from .config import DeployConfig, parse_config
from .credentials import NodeKey
from .deployment import LocalDeployment, copy_app
from .evidence import intruder_report, reply_node_ids
from .kills import Reaper, plan_kills
from .output import RESULT_PREFIX, ResultScanner, log
from .processes import Proc

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
INTRUDER_GRACE = 20.0  # seconds an intruder may take to be refused, once the run is over


def _interrupt(signum, frame):  # SIGTERM/SIGHUP behave like Ctrl-C: clean up and leave
    raise KeyboardInterrupt


class Session:
    """Runs one ``LocalDeployment`` with the ``flwr run`` of ``run_config``; ``run()`` returns the
    exit status (0 with a result, 1 without, 2 on timeout, 130 when interrupted)."""

    def __init__(self, config: DeployConfig, run_config: str) -> None:
        self.config, self.run_config = config, run_config
        self.dep = LocalDeployment(config)
        self.scanner = ResultScanner()
        self.started = threading.Event()  # flwr run printed "Successfully started run"
        self.info: dict[str, Any] = {"nodes": config.nodes, "taus": list(config.taus) if config.taus else None,
                                     "scratch": str(self.dep.work), "secure": config.secure}
        self.intruders: list[tuple[Proc, NodeKey]] = []
        kills, seed = plan_kills(config)
        self.reaper = Reaper(kills, self.dep, config.revive_after, config.spare_replies)
        if kills:
            self.info["kill_seed"] = seed

    def run(self) -> int:
        status = 1
        try:
            t0 = time.monotonic()
            app = copy_app(self.config.app, self.dep.work / "app")
            self._start(t0)
            status = self._follow(app, t0)
        except KeyboardInterrupt:
            log("interrupted")
            status = 130
        except (RuntimeError, TimeoutError) as err:
            log(f"error: {err}")
            status = 1
        finally:
            for sig in SIGNALS:  # let the clean-up finish
                signal.signal(sig, signal.SIG_IGN)
            self._shut_down()
        return self._report(status)

    # ---------------------------------------------------------------- start-up
    def _start(self, t0: float) -> None:
        dep, n = self.dep, self.config.nodes
        dep.start_superlink()
        mode = " with TLS and SuperNode authentication" if self.config.secure else ""
        log(f"SuperLink on 127.0.0.1:{dep.port}{mode} (pid {dep.superlink.pid}), scratch {dep.work}")
        if self.config.secure:
            ids = dep.register_keys()
            self.info["registered_node_ids"] = [ids[i] for i in range(n)]
            log(f"registered the public keys of {n} SuperNodes: node ids {self.info['registered_node_ids']}")
        for i in range(n):
            dep.start_node(i)
        self.info["nodes_ready_seconds"] = round(dep.wait_nodes(n), 2)
        self.info["startup_seconds"] = round(time.monotonic() - t0, 2)
        log(f"{n} SuperNodes online after {self.info['startup_seconds']:.1f} s "
            f"(pids {[p.pid for p in dep.nodes.values()]})")

    # ---------------------------------------------------------------- the run
    def _follow(self, app: Path, t0: float) -> int:
        flwr, cmd = self.dep.start_run(app, self.run_config)
        log("$ " + shlex.join(cmd[1:]))
        t_run = time.monotonic()
        reader = threading.Thread(target=self._pump, args=(flwr,), daemon=True)
        reader.start()
        status = None
        while status is None and (flwr.alive() or reader.is_alive()):
            now = time.monotonic()
            if now - t0 > self.config.timeout:
                log(f"timeout after {self.config.timeout} s")
                status = 2
            elif self.started.is_set():
                self._on_schedule(now - t_run)
            reader.join(timeout=0.2)
        self.info["run_seconds"] = round(time.monotonic() - t_run, 2)
        self.info["flwr_run_returncode"] = flwr.popen.poll()
        return status if status is not None else 0 if self.scanner.result is not None else 1

    def _pump(self, flwr: Proc) -> None:
        """Copy ``flwr run``'s output to its log (and stdout unless --quiet); scan it."""
        assert flwr.popen.stdout is not None
        with open(self.dep.logs / "flwr-run.log", "w", encoding="utf-8") as run_log:
            for line in flwr.popen.stdout:
                run_log.write(line)
                run_log.flush()
                if not self.config.quiet:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                if "Successfully started run" in line:
                    self.started.set()
                self.scanner.feed(line)

    def _on_schedule(self, elapsed: float) -> None:
        """Once a node has replied to a job (the ServerApp has numbered its workers and is sending
        them jobs; a node killed before it answered the partition query would fail the run): the
        intruders, and the kills and the revivals when due."""
        if not self.dep.events.reply_times():
            return
        cfg = self.config
        if cfg.intruders and not self.intruders:
            self.intruders = [self.dep.start_intruder(j) for j in range(cfg.intruders)]
            self.info["intruders_started_at_seconds"] = round(elapsed, 2)
            log(f"started {cfg.intruders} SuperNode(s) with unregistered keys "
                f"(pids {[p.pid for p, _ in self.intruders]})")
        self.reaper.step(elapsed)

    # ---------------------------------------------------------------- shutdown and report
    def _shut_down(self) -> None:
        try:
            if self.config.secure and self.dep.superlink is not None:
                self._record_security()
        finally:
            left = self.dep.stop()
            log(f"processes still alive after cleanup: {left}" if left else "all processes stopped")
            self.info["leftover_pids"] = left
            self.info["superlink_port"] = self.dep.port
            self.info["node_stats"] = self.dep.events.node_stats()
            if self.reaper.kills:
                self.info["kills"] = self.reaper.report(self.dep.events)

    def _record_security(self) -> None:
        """Before anything is stopped: whether the SuperLink answers over TLS and not in clear, its
        node list, the node ids it took replies from, and how each intruder was refused."""
        deadline = time.monotonic() + INTRUDER_GRACE
        while any(p.alive() for p, _ in self.intruders) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.info["tls_health"] = self.dep.health(tls=True)
        self.info["plain_http_health"] = self.dep.health(tls=False)
        nodes = self.dep.list_nodes()
        self.info["superlink_nodes"] = None if nodes is None else [
            {"node_id": int(nd["node-id"]), "status": nd.get("status")} for nd in nodes]
        superlink_log = self.dep.superlink_log()
        self.info["reply_node_ids"] = reply_node_ids(superlink_log)
        self.info["last_reply_at"] = max(self.dep.events.reply_times(), default=None)  # wall time
        self.info["intruders"] = [intruder_report(p, key, superlink_log) for p, key in self.intruders]

    def _report(self, status: int) -> int:
        intruders = self.info.get("intruders", [])
        if len(intruders) < self.config.intruders:
            log(f"only {len(intruders)} of {self.config.intruders} intruders were started (no train reply came)")
            status = status or 1
        for rep in intruders:
            if not rep["refused"]:
                log(f"{rep['name']} was NOT refused: {rep}")
                status = status or 1
        if self.scanner.result is not None:
            text = json.dumps({**self.scanner.result, "deployment": self.info}, default=float)
            print(RESULT_PREFIX + text, flush=True)
            if self.config.json_out:
                self.config.json_out.parent.mkdir(parents=True, exist_ok=True)
                self.config.json_out.write_text(text + "\n", encoding="utf-8")
        else:
            log(f"no '{RESULT_PREFIX.strip()}' line in the run's log ({self.dep.logs / 'flwr-run.log'})")
            status = status or 1
        if self.config.keep or status != 0:
            log(f"logs kept in {self.dep.logs}")
        else:
            shutil.rmtree(self.dep.work, ignore_errors=True)
        return status


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    try:
        run_config = config.flwr_run_config()
    except (ValueError, OSError, tomllib.TOMLDecodeError) as err:
        log(f"error: {err}")
        return 1
    for sig in SIGNALS:  # SIGINT too: a shell may start a background job with SIGINT ignored
        signal.signal(sig, _interrupt)
    return Session(config, run_config).run()

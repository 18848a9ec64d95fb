"""The processes a deployment starts: each in its own session, logged, and all stopped by PID.

Every process gets ``MARKER=<tag>`` in its environment (children inherit it), so that ``stop()``
also finds the ones that left our process groups (the SuperLink starts its SuperExec in a new
session) without matching anything by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from .output import log

MARKER = "FL_RESCALED_DEPLOY_ID"  # set in every started process's environment (children inherit it)

#: Called with (process name, wall time, line) for every line a logged process prints.
LineHook = Callable[[str, float, str], None]


class Proc:
    """One started process; its output goes to ``logfile`` (or to whoever reads ``popen.stdout``)."""

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

    def kill_group(self) -> None:
        """SIGKILL the process and everything in its process group, and reap it."""
        signal_group(self.pid, signal.SIGKILL)
        self.popen.wait()


class ProcessSet:
    """Starts processes in new sessions under one marker; ``stop()`` ends every one of them."""

    def __init__(self, tag: str, env: dict[str, str], cwd: Path, logs: Path, on_line: LineHook) -> None:
        self.tag, self.env, self.cwd, self.logs, self.on_line = tag, {**env, MARKER: tag}, cwd, logs, on_line
        self.procs: list[Proc] = []
        self._lock = threading.Lock()
        self._stopped = False

    def spawn(self, name: str, cmd: list[str], *, env: dict[str, str] | None = None,
              capture: bool = False) -> Proc:
        """Start ``cmd`` in a new process group (session).

        ``capture``: the caller reads its stdout; otherwise a thread copies it to
        ``logs/<name>.log`` with a wall-clock timestamp per line and hands each line to ``on_line``.
        """
        logfile = None if capture else self.logs / f"{name}.log"
        full_env = {**self.env, **(env or {}), MARKER: self.tag}
        with self._lock:
            if self._stopped:
                raise RuntimeError("deployment is stopping")
            popen = subprocess.Popen(
                cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=self.cwd, start_new_session=True, text=True, bufsize=1,
                errors="replace",
            )
            proc = Proc(name, popen, logfile)
            self.procs.append(proc)
        if not capture:
            threading.Thread(target=self._pump_log, args=(proc,), daemon=True).start()
        return proc

    def _pump_log(self, proc: Proc) -> None:
        assert proc.popen.stdout is not None and proc.logfile is not None
        with open(proc.logfile, "a", encoding="utf-8") as f:
            for line in proc.popen.stdout:
                now = time.time()
                f.write(f"{now:.3f} {line}")
                f.flush()
                self.on_line(proc.name, now, line)

    def stop(self, first: list[str], grace: float = 5.0) -> list[int]:
        """Stop every process started here, by PID; returns the PIDs still alive afterwards.

        ``first``: name prefixes to stop before the others, in that order (SIGTERM lets SuperNodes
        deregister before the SuperLink goes).
        """
        with self._lock:
            self._stopped = True
            procs = list(self.procs)
        order: list[Proc] = []
        for prefix in first:
            order += [p for p in procs if p.name.startswith(prefix) and p not in order]
        order += [p for p in procs if p not in order]
        for p in order:
            if p.alive():
                signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in order:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in order:  # the group may hold children even after its leader exited
            signal_group(p.pid, signal.SIGKILL)
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log(f"{p.name} (pid {p.pid}) did not exit")
        return self._stop_marked(grace)

    def _stop_marked(self, grace: float) -> list[int]:
        """Processes that left our groups but carry the marker: SIGTERM, then SIGKILL."""
        left = marked_pids(self.tag)
        for pid in left:
            signal_pid(pid, signal.SIGTERM)
        t_end = time.monotonic() + grace
        while left and time.monotonic() < t_end:
            time.sleep(0.1)
            left = marked_pids(self.tag)
        for pid in left:
            signal_pid(pid, signal.SIGKILL)
        time.sleep(0.2 if left else 0.0)
        return marked_pids(self.tag)


def marked_pids(tag: str) -> list[int]:
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


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

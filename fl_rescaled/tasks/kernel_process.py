"""MNIST gradients in a second process, beside the event loop's Python (the in-process Grid, ``--workers`` ≥ 2).

The event loop's Python holds the GIL; a kernel on a thread of the same process waits for it after
every torch op, so in one process the two never overlap (``benchmarks/bench_gil.py``). A worker
process has its own interpreter: the main process writes a job's model and minibatch rows into a
slot of a shared-memory file, sends the slot's number through the worker's stdin, and reads the
gradient (or, for a job of local SGD steps, the trained model), written over the model, from the slot
when the job's reply is pulled. The worker computes exactly the one-job batched kernels of the in-process path
(``batched.rows_job``: ``mlp_gradients`` or ``local_steps`` on one model, one torch thread), on data
it loads itself from the task's spec, so the bits are the same. A job whose reply is wanted before the
worker has started it is computed by the caller instead, with the same function
(``result(steal=True)``: the worker takes jobs in the order they were sent, the caller wants them in
the order they end); a job no longer wanted (``abandon``) is skipped the same way if not started.

A worker is started with ``python -P -m fl_rescaled.tasks.kernel_worker`` (the caller's package
first on its path, not the working folder's; what it writes to stderr before it is ready is quoted
when it fails to start), never by re-importing the caller's main module (as multiprocessing's spawn
would); a task has ``PROCESSES`` of them (two where three cores are free, each job to the least
busy), shared by every run of the process with that task; each ends when its stdin closes (at the
caller's exit, or ``close``). A worker that fails, dies or stops answering for ``TIMEOUT`` seconds
raises ``KernelProcessError`` for the jobs it held: the Grid computes them in process, same bits.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ..settings import available_cores
from .batched import onednn

#: Slots of one worker: jobs sent and not yet collected (a model-sized array each, the model sent and
#: then its result: 128 MNIST slots are 53 MB); with all of them taken a job runs in process.
SLOTS = 128
#: The most local SGD steps a job sent to the worker may take (a job with more runs in process).
MAX_STEPS = 16
#: Seconds without an answer after which a worker is given up (its jobs are computed in process).
TIMEOUT = 120.0
_READY, _STOP, _FAILED, _SKIPPED = 0x7FFFFFF0, -1, 0x40000000, 0x20000000
log = logging.getLogger("flwr.fl_rescaled")


class KernelProcessError(RuntimeError):
    """The worker failed, died or stopped answering: compute its jobs in process."""


def _layout(size: int, batch: int, slots: int) -> dict[str, tuple[int, np.dtype, tuple[int, ...]]]:
    """Where each array of the shared file lies: name -> (offset, dtype, shape). ``models``: each slot's
    model as sent, which the worker overwrites with the job's result (the gradient, or the trained
    model), each slot's row starting on a 64-byte boundary (a product's last bit can depend on its
    buffer's alignment: ``tasks.base.scratch``). ``job``: the job's local
    steps (0: a gradient), learning rate and proximal weight; ``taken``: set by the worker when it
    starts a job, ``stolen``: set by the caller that computes the job itself (``result(steal=True)``)."""
    out, offset = {}, 0
    padded = -(-size // 16) * 16
    for name, dtype, shape in (("models", np.float32, (slots, padded)), ("rows", np.int64, (slots, MAX_STEPS * batch)),
                               ("job", np.float64, (slots, 3)), ("losses", np.float64, (slots,)), ("taken", np.int32, (slots,)),
                               ("stolen", np.int32, (slots,))):
        out[name] = (offset, np.dtype(dtype), shape)
        offset += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 64) * 64
    out["total"] = (offset, np.dtype(np.uint8), ())
    return out


def _child_env() -> dict[str, str]:
    """This environment, with this ``fl_rescaled``'s folder first on the path and this process's kernel."""
    env = os.environ.copy()
    env["FL_RESCALED_ONEDNN"] = "1" if onednn() else "0"  # the worker's bits are the caller's
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def _room(folder: str, nbytes: int) -> bool:
    """Whether ``folder`` is writable with ``nbytes`` free (a container's /dev/shm may hold 64 MB only:
    writing past its end would kill the process, not raise)."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):  # (no such folder; no statvfs off POSIX)
        return False
    return os.access(folder, os.W_OK) and st.f_bavail * st.f_frsize >= nbytes


def _shared_file(nbytes: int) -> str:
    """A new file of ``nbytes`` with its blocks reserved, in /dev/shm when it has room, else in the
    temporary folder. A sparse file on a filesystem that fills up kills the process with SIGBUS at the
    first write past the room ("Bus error"); a refused reservation raises OSError here (jobs in process)."""
    if _room("/dev/shm", 2 * nbytes):
        try:
            return _reserved("/dev/shm", nbytes)
        except OSError:
            pass  # (filled since it was measured: the temporary folder then)
    return _reserved(None, nbytes)


def _reserved(folder: str | None, nbytes: int) -> str:
    fd, path = tempfile.mkstemp(prefix="fl-rescaled-kernel-", dir=folder)
    try:
        os.ftruncate(fd, nbytes)
        if hasattr(os, "posix_fallocate"):  # (Linux, the BSDs; elsewhere the file stays sparse)
            os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


def _views(mem: np.ndarray, layout: dict, size: int) -> dict[str, np.ndarray]:
    """The arrays of the shared file; each slot's model (then result) without its padding."""
    out = {name: np.ndarray(shape, dtype, buffer=mem, offset=offset)
           for name, (offset, dtype, shape) in layout.items() if name != "total"}
    out["models"] = out["models"][:, :size]
    return out


class KernelProcess:
    """One worker process computing one MNIST task's gradient jobs (see the module docstring)."""

    def __init__(self, spec: str, size: int, batch: int, slots: int = SLOTS) -> None:
        self.spec, self.slots = spec, int(slots)
        self._owner = os.getpid()  # (a forked child must not speak on its parent's pipes)
        layout = _layout(size, batch, self.slots)
        path = _shared_file(layout["total"][0])
        try:
            self._mem = np.memmap(path, dtype=np.uint8, mode="r+")
            self.arrays = _views(self._mem, layout, size)
            self._err = tempfile.TemporaryFile()  # (what the worker says before it is ready: quoted if it fails)
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "fl_rescaled.tasks.kernel_worker", path, str(self.slots), str(size),
                 str(batch), spec],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=_child_env(), bufsize=0)
            self._lock = threading.Lock()
            self._inbox = bytearray()
            self._free = list(range(self.slots))[::-1]
            self._done: set[int] = set()
            self._abandoned: set[int] = set()
            self._failed: set[int] = set()  # answered "could not compute", not yet asked for
            self._skipped: set[int] = set()  # skipped by the worker as stolen, not yet asked for
            self._said_failed = False
            self.broken = self.started = False
            self.answered = 0  # jobs whose results were collected
            self._owed = 0  # jobs sent and not answered yet
            self._heard = time.monotonic()  # the last answer (or the first job sent since all were answered)
            self.stolen = 0  # jobs left to the caller (``result(steal=True)``)
            try:
                ready = self._read() == _READY
            except KernelProcessError:
                ready = False
            if not ready:
                self._break()
                said = self._last_words()
                raise KernelProcessError(f"the worker said: {said}" if said else "the kernel process did not start")
            self.started = True
        finally:
            os.unlink(path)  # (both processes hold the mapping; the file goes when they do)
            if hasattr(self, "_err"):
                self._err.close()

    def _last_words(self) -> str:
        """The last line the worker wrote to stderr (a traceback's last line), or nothing."""
        try:
            self._proc.wait(timeout=5)
            self._err.seek(0, os.SEEK_END)
            self._err.seek(max(0, self._err.tell() - 4096))
            lines = [ln.strip() for ln in self._err.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return lines[-1][:300] if lines else ""

    # -- the pipe
    def _read(self) -> int:
        """The worker's next answer (4 bytes), read from the pipe itself: a buffered reader could
        hold answers that ``select`` no longer sees."""
        while len(self._inbox) < 4:
            self._fill(block=True)
        return self._pop()

    def _pop(self) -> int:
        """The first answer in the inbox (it holds 4 bytes or more), taken out."""
        got = struct.unpack_from("<i", self._inbox)[0]
        del self._inbox[:4]
        return got

    def _fill(self, block: bool) -> bool:
        """Add what the worker has written to the inbox: False when there is nothing and not ``block``;
        raises when it exited, or (``block``) said nothing for ``TIMEOUT`` seconds."""
        fd = self._proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], TIMEOUT if block else 0)
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            if not block:
                return False
            self._break(f"no answer within {TIMEOUT:g} s" if not ready else "it exited")
            raise KernelProcessError("the kernel process died or stopped answering")
        self._inbox += chunk
        return True

    def _break(self, why: str = "it died or stopped answering") -> None:
        if self.started and not self.broken:
            log.warning("The MNIST gradients' worker process stopped (%s): its jobs run in this process, with "
                        "the same results (%d restarts left; --workers 1 keeps every job in process).",
                        why, max(0, RESTARTS + PROCESSES - _STARTS.get(self.spec, 0)))
        self.broken = True
        try:
            self._proc.kill()
        except OSError:
            pass

    # -- jobs
    def submit(self, model: np.ndarray, rows: np.ndarray, steps: int = 0, lr: float = 0.0,
               prox: float = 0.0) -> int | None:
        """Send one job: a gradient at ``model`` on the minibatch ``rows`` (``steps`` = 0), or
        ``steps`` local SGD steps (``batched.local_steps``), one row of ``rows`` each, on one torch
        thread. Its slot, or None when every slot is taken or it has too many steps (compute it in
        process)."""
        rows = np.asarray(rows, np.int64).reshape(max(steps, 1), -1)
        if os.getpid() != self._owner:
            return None
        with self._lock:
            if self.broken or not self._free or steps > MAX_STEPS or self._silent():
                return None
            slot = self._free.pop()
            self.arrays["taken"][slot] = self.arrays["stolen"][slot] = 0
            self.arrays["models"][slot] = model
            self.arrays["rows"][slot, :rows.size] = rows.reshape(-1)
            self.arrays["job"][slot] = (steps, lr, prox)
            try:
                self._proc.stdin.write(struct.pack("<i", slot))
                self._proc.stdin.flush()
            except OSError as exc:
                self._break("it exited")
                raise KernelProcessError("the kernel process is gone") from exc
            if not self._owed:
                self._heard = time.monotonic()
            self._owed += 1
            return slot

    def _silent(self) -> bool:
        """Whether the worker owes answers and has given none for ``TIMEOUT`` seconds (then it is given
        up: a stopped worker whose jobs are all stolen would otherwise never be found out)."""
        if self._owed and time.monotonic() - self._heard > TIMEOUT:
            self._break(f"no answer within {TIMEOUT:g} s")
            return True
        return False

    def result(self, slot: int, use=None, steal: bool = False):
        """``use(gradient, loss)`` of the job (the gradient a view of its slot, free again after it;
        without ``use``: a copy of the gradient and the loss). With ``steal``, a job the worker has not
        started is left to the caller: None, and the worker skips it (or, if it started it at that very
        moment, computes it for nothing)."""
        if os.getpid() != self._owner:
            raise KernelProcessError("this worker belongs to the process this one was forked from")
        with self._lock:
            block = False
            while slot not in self._done:
                if slot in self._failed:
                    self._failed.discard(slot)
                    self._free.append(slot)
                    raise KernelProcessError("the kernel process could not compute the job")
                if slot in self._skipped:  # (the worker saw it stolen, this side saw it started)
                    self._skipped.discard(slot)
                    self._free.append(slot)
                    self.stolen += 1
                    return None
                if self.broken:
                    raise KernelProcessError("the kernel process is gone")
                if block and steal:
                    if self._silent():
                        raise KernelProcessError("the kernel process stopped answering")
                    self.arrays["stolen"][slot] = 1
                    if not self.arrays["taken"][slot]:
                        self._abandoned.add(slot)  # (freed when the worker answers it)
                        self.stolen += 1
                        return None
                    steal = False
                self._pump(block)
                block = True
            self._done.discard(slot)
            self.answered += 1
            grad, loss = self.arrays["models"][slot], float(self.arrays["losses"][slot])  # (the result, over the model)
            try:
                return (grad.copy(), loss) if use is None else use(grad, loss)
            finally:
                self._free.append(slot)

    def _pump(self, block: bool) -> None:
        """Take in the worker's answers: every one already written, or (``block``) at least one."""
        if len(self._inbox) < 4 and not self._fill(block):
            return
        self._heard = time.monotonic()
        while len(self._inbox) >= 4:
            got = self._pop()
            self._owed -= 1
            flags = got & (_FAILED | _SKIPPED)
            got &= ~(_FAILED | _SKIPPED)
            if not 0 <= got < self.slots:
                self._break(f"it answered slot {got}")
                raise KernelProcessError(f"the kernel process answered slot {got}, not one of ours")
            if got in self._abandoned:
                self._abandoned.discard(got)
                self._free.append(got)
            elif flags & _SKIPPED:
                self._skipped.add(got)
            elif flags & _FAILED:
                self._failed.add(got)  # (its owner hears it when it asks: the slot stays taken till then)
                if not self._said_failed:
                    self._said_failed = True
                    log.warning("The MNIST gradients' worker process could not compute a job: such jobs run "
                                "in this process, with the same results.")
            else:
                self._done.add(got)

    def abandon(self, slot: int) -> None:
        """Forget a job no longer wanted (the worker skips it unless started; its slot is free once answered)."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            if slot in self._done or slot in self._failed or slot in self._skipped:
                for held in (self._done, self._failed, self._skipped):
                    held.discard(slot)
                self._free.append(slot)
            else:
                self.arrays["stolen"][slot] = 1
                self._abandoned.add(slot)

    def close(self) -> None:
        if os.getpid() != self._owner:
            return
        self.broken = True
        try:
            self._proc.stdin.write(struct.pack("<i", _STOP))
            self._proc.stdin.close()
            self._proc.wait(timeout=10)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self._proc.kill()


_WORKERS: dict[str, list[KernelProcess]] = {}
_WORKERS_LOCK = threading.Lock()
#: Workers started again after one broke, per task, before the jobs of that task stay in process.
RESTARTS = 3
_STARTS: dict[str, int] = {}
#: Worker processes per task: two where this process may use three cores or more (beside the event
#: loop's), one on two cores (three busy processes on two cores ran slower than two).
PROCESSES = 2 if available_cores() >= 3 else 1


def worker_for(spec: str, size: int, batch: int) -> KernelProcess | None:
    """The least busy of task ``spec``'s ``PROCESSES`` workers (each started on first use, again after
    one broke, at most ``RESTARTS`` times in all; the workers of another task are closed first), or
    None when none can run. Which worker computes a job changes no bit of its reply."""
    with _WORKERS_LOCK:
        if spec not in _WORKERS:
            for other in _WORKERS.values():  # (one task at a time: each worker holds the data and torch)
                for w in other:
                    w.close()
            _WORKERS.clear()
        pool = _WORKERS.setdefault(spec, [])
        pool[:] = [w for w in pool if not w.broken]
        if len(pool) < PROCESSES and _STARTS.get(spec, 0) <= RESTARTS + PROCESSES - 1:
            _STARTS[spec] = _STARTS.get(spec, 0) + 1
            try:
                pool.append(KernelProcess(spec, size, batch))
            except (OSError, KernelProcessError) as exc:
                log.warning("The MNIST gradients' worker process could not start (%s): the jobs run in this "
                            "process, with the same results.", exc)
        return min(pool[:PROCESSES], key=lambda w: w._owed) if pool else None


def _forget_after_fork() -> None:
    """In a forked child: the parent's workers are not this process's (it starts its own)."""
    global _WORKERS_LOCK  # noqa: PLW0603 - (a lock another thread held at the fork stays held in the child)
    _WORKERS_LOCK = threading.Lock()
    _WORKERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


@atexit.register
def close_all() -> None:
    with _WORKERS_LOCK:
        for pool in _WORKERS.values():
            for w in pool:
                w.close()
        _WORKERS.clear()

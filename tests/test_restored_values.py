"""Every restored value is checked by its owner (issue 26): a checkpoint crafted to hold a wrong value
is refused when a run resumes from it, with one line and exit status 2; it never hangs the resume,
ends it in a traceback, or lets it run on from the wrong value.

Each case (``CASES``: name -> base run, what it changes) takes the checkpoint of a small run,
changes one value in it as an attacker with the file could (the JSON ``state.json``, an
``arrays/N.npy`` member, or a member's size) and resumes with the same command line. The file is
written again as a zip of the same layout with true CRCs (the header holds no digest of the
members), so it passes the container's checks and reaches the value checks. The resume must exit
2 with one non-empty line on stderr naming ``run.ckpt`` and containing one of the case's words
(``WHY``: loose, adjusted in one place if the wording changes).

Each resume runs in its own subprocess under a time limit (``HANG``) that fails the test as "hung"
(a restored value that hangs the run, not a timing assertion) and an address-space cap (``MEMORY``;
a resume needs well under 0.5 GiB) so a restored size cannot make it allocate GiBs. The intact
checkpoint of each base run still resumes (exit 0).

The clock's fields sit in its completion source's part of the manager's record
(``run.manager.virtual.<name>``); ``part`` finds a field there or in the manager's own.
"""

from __future__ import annotations

import io
import json
import math
import resource
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from conftest import ROOT

HANG = 60  # seconds: a resume of these runs takes about one
MEMORY = 2 * 2**30  # bytes of address space a resume may map

QUAD = ["--task", "quadratic", "--quad-dim", "4", "--noise", "0.2", "--delays", "exponential", "--lr", "0.05",
        "--budget", "300", "--eval-every", "50", "--seed", "3", "--strategy", "rescaled", "--workers", "1"]
THREE = ["--taus", "1,2,3", "--quad-a", "1,2,1", "--quad-b", "0,3,-2"]
DAILY = ["--availability", "daily", "--availability-period", "24"]
#: The base runs, each checkpointed at t ≈ 200 of 300 with jobs in flight: every worker always busy
#: (C = N); a sampled population (C = 3 of N = 8: an idle pool, a generator, delivery periods) of
#: clients online 30% of each 24-unit day (clients come back after the checkpoint: parked slots are
#: refilled); three clients online half of each day, C = N (a pending event: a client coming back).
BASES = {
    "all-busy": [*QUAD, *THREE],
    "sampled": [*QUAD, "--num-clients", "8", "--concurrency", "3", *DAILY, "--availability-fraction", "0.3"],
    "daily": [*QUAD, *THREE, *DAILY],
}
EVERY = "100"


# ---------------------------------------------------------------------------------------- the file
class Crafted:
    """A run checkpoint opened for editing: ``tree`` (state.json), ``arrays`` (name -> array) and the
    header; ``write`` puts it back as a zip of the same layout (``pad_state``: that many NUL bytes
    after state.json's JSON, left as a hole in the file, so a huge member costs no disk where the
    file system has sparse files)."""

    def __init__(self, data: bytes) -> None:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            self.header = json.loads(zf.read("header.json"))
            self.tree = json.loads(zf.read("state.json"))
            self.arrays = {name: np.load(io.BytesIO(zf.read(f"arrays/{i}.npy")), allow_pickle=False)
                           for i, name in enumerate(self.header["arrays"])}
        self.pad_state = 0

    # (the values)
    def array(self, ref: Any) -> np.ndarray:
        """A writable copy of the array an ``{"$array": name}`` entry refers to."""
        return np.array(self.arrays[ref["$array"]])

    def put(self, ref: Any, value: np.ndarray) -> None:
        self.arrays[ref["$array"]] = np.asarray(value)

    def add(self, name: str, value: np.ndarray) -> dict:
        """A new array member; its ``{"$array": name}`` entry."""
        self.header["arrays"].append(name)
        self.arrays[name] = np.asarray(value)
        return {"$array": name}

    # (the file)
    def members(self) -> dict[str, bytes]:
        out = {"header.json": json.dumps(self.header).encode(), "state.json": json.dumps(self.tree).encode()}
        for i, name in enumerate(self.header["arrays"]):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(self.arrays[name]), allow_pickle=False)
            out[f"arrays/{i}.npy"] = buf.getvalue()
        return out

    def write(self, path: Path) -> None:
        members = self.members()
        if not self.pad_state:
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
                for name, data in members.items():
                    zf.writestr(name, data)
            path.write_bytes(buf.getvalue())
            return
        state = members.pop("state.json")
        _sparse_zip(path, members, "state.json", state, self.pad_state)


def _sparse_zip(path: Path, members: dict[str, bytes], big: str, head: bytes, pad: int) -> None:
    """A stored (uncompressed) zip of ``members`` and, last, ``big``: ``head`` then ``pad`` NUL bytes,
    left as a hole in the file (sparse: no disk used), with its true size and CRC-32."""
    crc, zero = zlib.crc32(head), bytes(2**26)
    for _ in range(pad // len(zero)):
        crc = zlib.crc32(zero, crc)
    crc = zlib.crc32(zero[: pad % len(zero)], crc)
    central = []
    with path.open("wb") as fh:
        for name, data, size, crc32 in [*((n, d, len(d), zlib.crc32(d)) for n, d in members.items()),
                                        (big, head, len(head) + pad, crc)]:
            offset, raw = fh.tell(), name.encode()
            fh.write(struct.pack("<4s2B4HL2L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, 0x21, crc32, size, size,
                                 len(raw), 0) + raw + data)
            if size > len(data):
                fh.seek(size - len(data), io.SEEK_CUR)
            central.append(struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", 20, 3, 20, 0, 0, 0, 0, 0x21, crc32, size,
                                       size, len(raw), 0, 0, 0, 0, 0o644 << 16, offset) + raw)
        start = fh.tell()
        fh.write(b"".join(central))
        fh.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(central), len(central), fh.tell() - start,
                             start, 0))


# ---------------------------------------------------------------------------------------- the fields
def manager(tree: dict) -> dict:
    return tree["run"]["manager"]


def part(tree: dict, name: str) -> dict:
    """The record that holds the manager's field ``name``: the manager's own, or its completion
    source's (the clock's fields: ``now``, ``delays``, ``free_at``, ``periods``, ``last_delivery``,
    ``events``, ``woken``)."""
    m = manager(tree)
    if name in m:
        return m
    for source in (m.get("virtual"), m.get("wall")):
        if isinstance(source, dict) and name in source:
            return source
    raise KeyError(f"no field {name!r} in run.manager or its source's part")


def get(tree: dict, name: str) -> Any:
    return part(tree, name)[name]


def put(tree: dict, name: str, value: Any) -> None:
    part(tree, name)[name] = value


def jobs(tree: dict) -> list[dict]:
    return get(tree, "jobs")


def algorithm(tree: dict) -> dict:
    """The strategy's state."""
    return tree["algorithm"]


# ---------------------------------------------------------------------------------------- the cases
def set_field(name: str, value: Any) -> Callable[[Crafted], None]:
    return lambda c: put(c.tree, name, value)


def set_population(name: str, value: Any) -> Callable[[Crafted], None]:
    return lambda c: get(c.tree, "population").__setitem__(name, value)


def set_array(name: str, change: Callable[[np.ndarray], None], within: str | None = None
              ) -> Callable[[Crafted], None]:
    """Change the array of the manager's field ``name`` (or of its record ``within``'s field ``name``)
    in place: ``change(a)``."""
    def mutate(c: Crafted) -> None:
        ref = get(c.tree, name) if within is None else get(c.tree, within)[name]
        a = c.array(ref)
        change(a)
        c.put(ref, a)
    return mutate


def each_job(change: Callable[[dict], None]) -> Callable[[Crafted], None]:
    return lambda c: [change(job) for job in jobs(c.tree)]


def first_job(change: Callable[[dict], None]) -> Callable[[Crafted], None]:
    return lambda c: change(jobs(c.tree)[0])


def first_event(change: Callable[[list], None]) -> Callable[[Crafted], None]:
    def mutate(c: Crafted) -> None:
        events = get(c.tree, "events")
        assert events, "the base run has no pending event"
        change(events[0])
    return mutate


def short_answered(c: Crafted) -> None:
    """The run's "heard from" flags for one worker of three."""
    ref = c.tree["run"]["answered"]
    c.put(ref, c.array(ref)[:1])


def replica_step_sizes(c: Crafted) -> None:
    """Five replicas' step sizes in a run of one model."""
    c.tree["run"]["replica_lrs"] = c.add("run.replica_lrs", np.full(5, 0.05))


def event_before_now(c: Crafted) -> None:
    get(c.tree, "events")[0][0] = get(c.tree, "now") - 50.0


def degenerate_generator(c: Crafted) -> None:
    """The population's generator at PCG64 state 0 with increment 0: it draws 0 for ever (numpy's
    bounded draw then retries for ever, in C). (The delay model's generators already refuse an even
    increment.)"""
    rng = get(c.tree, "population")["rng"]["$rng"]
    rng["state"] = {"state": 0, "inc": 0}


def huge_state_member(c: Crafted) -> None:
    """state.json declared (and stored, as a hole) 3 GiB long: its size must be refused before it is
    read; read whole it would take 3 GiB (here: more than ``MEMORY``)."""
    c.pad_state = 3 * 2**30


def nested_config(job: dict) -> None:
    job["config"]["nested"] = {"a": [1, {"b": 2}]}


def finish_before_start(job: dict) -> None:
    job["finish_time"] = job["start_time"] - 1.0


def clock_before_dispatch(c: Crafted) -> None:
    """The clock set back before every job in flight was sent (and before the last evaluation)."""
    put(c.tree, "now", min(j["dispatch_time"] for j in jobs(c.tree)) - 1.0)


def duplicate_job_ids(c: Crafted) -> None:
    js = jobs(c.tree)
    js[1]["job_id"] = js[0]["job_id"]


def jobs_repeated(c: Crafted) -> None:
    put(c.tree, "jobs", jobs(c.tree) * 50)


def negated_alpha(c: Crafted) -> None:
    algorithm(c.tree)["alpha"] = -algorithm(c.tree)["alpha"]


def unknown_nodes(c: Crafted) -> None:
    roster = get(c.tree, "roster")
    roster["node_ids"] = [1001 + i for i in range(len(roster["node_ids"]))]


def books_version(c: Crafted) -> None:
    get(c.tree, "books")["version"] = 10**9


def in_flight_disagrees(c: Crafted) -> None:
    """One more job in flight for worker 0 in the books (sent too, so they still balance) than the
    jobs listed."""
    books = get(c.tree, "books")
    for name in ("in_flight", "jobs_sent"):
        a = c.array(books[name])
        a[0] += 1
        c.put(books[name], a)


def pool_empty(c: Crafted) -> None:
    get(c.tree, "population")["pool"]["size"] = 0


def all_offline(a: np.ndarray) -> None:
    a[:] = False


def first_huge(a: np.ndarray) -> None:
    a[0] = 1e308


def none_active(c: Crafted) -> None:
    put(c.tree, "active", [False] * len(get(c.tree, "active")))


def set_tau(worker: int, value: float) -> Callable[[Crafted], None]:
    def mutate(c: Crafted) -> None:
        get(c.tree, "periods")[worker] = value
    return mutate


#: name -> (base run, the change); ``WHY[name]``: what its refusal says
CASES: dict[str, tuple[str, Callable[[Crafted], None]]] = {
    # -- hangs
    "woken 1 at C = N": ("all-busy", set_field("woken", 1)),
    "woken 10**15 at C = N": ("all-busy", set_field("woken", 10**15)),
    "an unknown event kind": ("daily", first_event(lambda e: e.__setitem__(1, 7))),
    "parked 10**12": ("sampled", set_population("parked", 10**12)),
    "a degenerate PCG64 state": ("sampled", degenerate_generator),
    "an evaluation period of 1e-300": ("all-busy", lambda c: c.tree["run"]["schedule"].__setitem__("period", 1e-300)),
    # -- tracebacks
    "the clock's now negative": ("all-busy", set_field("now", -1.0)),
    "a job that finishes before it starts": ("all-busy", first_job(finish_before_start)),
    "an event before the clock's now": ("daily", event_before_now),
    "an event's worker out of range": ("daily", first_event(lambda e: e.__setitem__(2, 3))),
    "a nested value in a job's config": ("all-busy", first_job(nested_config)),
    "node ids the Grid does not have": ("all-busy", unknown_nodes),
    "books.version 10**9": ("all-busy", books_version),
    "a 3 GiB state member": ("all-busy", huge_state_member),
    "the run's answered flags for one worker of three": ("all-busy", short_answered),
    "replica step sizes in a run of one model": ("all-busy", replica_step_sizes),
    "no worker active in the τ table": ("all-busy", none_active),
    # -- accepted with a wrong value
    "the strategy's alpha negated": ("all-busy", negated_alpha),
    "the jobs in flight listed 50 times": ("all-busy", jobs_repeated),
    "no jobs in flight": ("all-busy", set_field("jobs", [])),
    "finish times inf": ("all-busy", each_job(lambda j: j.__setitem__("finish_time", math.inf))),
    "finish times NaN": ("all-busy", each_job(lambda j: j.__setitem__("finish_time", math.nan))),
    "a worker free at 1e308": ("all-busy", set_array("free_at", first_huge)),
    "every client offline": ("all-busy", set_array("online", all_offline, within="roster")),
    "an idle pool of 0": ("sampled", pool_empty),
    "a delivery period of 1e300": ("sampled", set_tau(0, 1e300)),
    "two jobs in flight with one id": ("all-busy", duplicate_job_ids),
    "the clock's now before its jobs were sent": ("all-busy", clock_before_dispatch),
    "a job that starts after it finishes": ("all-busy", first_job(lambda j: j.__setitem__("start_time", j["finish_time"] + 1.0))),
    "a job sent after it starts": ("all-busy", first_job(lambda j: j.__setitem__("dispatch_time", j["start_time"] + 1.0))),
    "next_job_id below a job in flight": ("all-busy", lambda c: put(c.tree, "next_job_id", min(j["job_id"] for j in jobs(c.tree)))),
    "a job's model version ahead of the books": ("all-busy", first_job(lambda j: j.__setitem__("version", j["version"] + 5))),
    "an unknown event kind at C < N": ("sampled", first_event(lambda e: e.__setitem__(1, 7))),
    "books.in_flight disagreeing with the jobs": ("all-busy", in_flight_disagrees),
}

#: What each refusal must say (one of the words, case-insensitive), besides naming run.ckpt.
WHY: dict[str, tuple[str, ...]] = {
    "woken 1 at C = N": ("woken", "slot"),
    "woken 10**15 at C = N": ("woken", "slot"),
    "an unknown event kind": ("event",),
    "parked 10**12": ("parked", "slot"),
    "a degenerate PCG64 state": ("generator",),
    "an evaluation period of 1e-300": ("period", "evaluat"),
    "the clock's now negative": ("time", "clock"),
    "a job that finishes before it starts": ("job", "time"),
    "an event before the clock's now": ("event",),
    "an event's worker out of range": ("worker",),
    "a nested value in a job's config": ("config",),
    "node ids the Grid does not have": ("node",),
    "books.version 10**9": ("version",),
    "a 3 GiB state member": ("state.json", "size", "large"),
    "the run's answered flags for one worker of three": ("answered", "worker"),
    "replica step sizes in a run of one model": ("replica",),
    "no worker active in the τ table": ("active", "worker"),
    "the strategy's alpha negated": ("alpha", "α", "lr"),
    "the jobs in flight listed 50 times": ("job",),
    "no jobs in flight": ("job", "update"),
    "finish times inf": ("time", "finish"),
    "finish times NaN": ("time", "finish"),
    "a worker free at 1e308": ("free", "time"),
    "every client offline": ("online", "offline"),
    "an idle pool of 0": ("pool", "idle"),
    "a delivery period of 1e300": ("period", "τ", "tau"),
    "two jobs in flight with one id": ("job",),
    "the clock's now before its jobs were sent": ("job", "clock"),
    "a job that starts after it finishes": ("job",),
    "a job sent after it starts": ("job",),
    "next_job_id below a job in flight": ("job id",),
    "a job's model version ahead of the books": ("version",),
    "an unknown event kind at C < N": ("event",),
    "books.in_flight disagreeing with the jobs": ("flight", "books"),
}


# ---------------------------------------------------------------------------------------- running
def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def resume(base: str, folder: Path) -> subprocess.CompletedProcess:
    """The base run's command resumed from ``folder`` (its own time limit and memory cap)."""
    cmd = [sys.executable, str(ROOT / "run_sim.py"), "--json", "--no-progress", *BASES[base], "--resume", str(folder)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=HANG, preexec_fn=_cap_memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung: no exit within {HANG} s of resuming {base} from {folder / 'run.ckpt'}")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Callable[[str], bytes]:
    """base name -> the bytes of its run's checkpoint (each base run made once, when first needed)."""
    made: dict[str, bytes] = {}

    def checkpoint(base: str) -> bytes:
        if base not in made:
            out = tmp_path_factory.mktemp(f"base-{base}")
            cmd = [sys.executable, str(ROOT / "run_sim.py"), "--json", "--no-progress", *BASES[base], "--out", str(out),
                   "--checkpoint-every", EVERY]
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=10 * HANG)
            assert r.returncode == 0, r.stderr[-2000:]
            made[base] = (out / "run.ckpt").read_bytes()
        return made[base]

    return checkpoint


@pytest.mark.parametrize("base", list(BASES))
def test_the_intact_checkpoint_still_resumes(checkpoints, tmp_path, base):
    Crafted(checkpoints(base)).write(tmp_path / "run.ckpt")  # (rewritten as the crafted ones are)
    r = resume(base, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("case", list(CASES))
def test_a_crafted_value_is_refused_with_one_line(checkpoints, tmp_path, case):
    base, mutate = CASES[case]
    crafted = Crafted(checkpoints(base))
    mutate(crafted)
    crafted.write(tmp_path / "run.ckpt")
    r = resume(base, tmp_path)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, f"exit {r.returncode}, stderr:\n{r.stderr[-3000:]}"
    assert "run.ckpt" in lines[0] and any(w.lower() in lines[0].lower() for w in WHY[case]), lines[0]


def test_every_case_says_what_its_refusal_names():
    assert set(WHY) == set(CASES)

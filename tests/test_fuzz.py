"""Fuzzing (hypothesis): arbitrary replies at the manager, arbitrary values at every flag and key.

**Replies.** A strategy runs on an in-process Grid whose ClientApp is replaced, job by job, by a
drawn reply: valid (random finite values, keys in any order, the ArrayRecord under any name, extra
records with odd metrics, values near the float type's limit, float arrays of another width) or
broken in one drawn way (record names, missing or extra arrays, shapes, integer, boolean or complex
arrays for float ones, NaN/inf, bytes that are not ``.npy``, other
serialisations, declared shapes of 10^12 elements, a 16 MB payload, an error reply, no content, a
wrong message type), plus duplicates and replies to jobs never sent, slipped in at pull time. The
oracle is per event: a valid reply is applied; any other is rejected with a reason of its kind and
the model is bit for bit what it was (unless that rejection set its worker aside, the third in a
row: a round that waited for it may then close with the others' updates); every reply the Grid
handed over reached the strategy exactly once, as applied or rejected (a reply dropped on the way
would leave its job "in flight", where the books still balance); the books balance at the end, and the run either reaches its budget or stops with ``RunFailed`` (the loud failure), never
with another exception. Four setups on the virtual clock: Rescaled ASGD on one float64 array (the hot path), Rescaled ASGD and FedBuff
taking trained models of a float32 model with an int64 counter (BatchNorm-like), Malenia SGD on the
layered model taking gradients (rounds, cancelled jobs); and two on the wall clock (a threaded
in-process Grid whose nodes take a few milliseconds per job): Rescaled ASGD, and Malenia SGD, whose
rounds cancel jobs whose replies may already have come (their compute time is read from them,
``WallSource.cancel_reply_time``). Replies with
hostile metrics (NaN, ±inf, a negative or fractional ``num-examples``, a ``compute-time`` of 1e9,
NaN or −5, text, booleans, an int beyond any float, a ``$`` key, a ConfigRecord ``compute-time``)
must be applied with those metrics dropped: every metric a completion carries is a finite number
or a list of them. Valid replies of extreme size may instead be rejected as outliers
(``fl_rescaled.bounds``).

**Flags and run-config keys.** Every ``run_sim.py`` flag and every Flower run-config key gets drawn
values (numbers of every size and sign, NaN, inf, lists, text, empty): parsing and validation
either give a run or a ``ValueError`` that becomes exit status 2 with one line naming the flag or
key at fault (dropping what it names changes the answer). A few dozen drawn command lines also run
end to end (on the quadratic, small budgets) through ``cli.main``: exit 2 (one line) exactly when
parsing refuses them; otherwise exit 0, or 1 (one line) only for a run that diverged (non-finite
gradients); never a traceback.

How many cases the suite tries is ``FUZZ_CASES`` below (docs/reliability.md quotes it, and
tests/test_docs.py checks the quote): the same cases on every run (derandomised), about two minutes on the 2-core development machine. The tests at the end
are the inputs that fuzzing found broken, one each, kept as regression tests.
"""

from __future__ import annotations

import contextlib
import io
import math
import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fl_rescaled.manager import OnEvent
from fl_rescaled.manager.manager import SET_ASIDE_AFTER
from fl_rescaled import (DelayModel, FedBuff, InProcessGrid, MaleniaSGD, RescaledASGD, RunFailed, VirtualClock,
                         WallClock)
from fl_rescaled import cli
from fl_rescaled.layout import encode_array
from fl_rescaled.server_app import STRATEGY_OPTIONS_KEY, run_config_keys, spec_from_run_config
from fl_rescaled.strategies import STRATEGIES, options
from conftest import run_of, start_run

REPLIES_PER_SETUP = 300
WALL_REPLIES_PER_SETUP = 150
WALL_BUDGET = 100  # milliseconds of each wall-clock case (WallClock(0.001))
FLAG_CASES = 1000
CONFIG_CASES = 1000
MAIN_CASES = 40  # (FUZZ_CASES, the total, is counted below the flags' tests)



def fuzz(examples: int) -> settings:
    """Derandomised (the same cases on every run and machine), no example database, no deadline."""
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ================================================================================ replies
#: What each broken kind may be rejected as (a valid reply must be applied).
REASONS = {
    "no-arrays": {"malformed"}, "two-records": {"malformed"}, "key-renamed": {"malformed"},
    "key-missing": {"malformed"}, "key-extra": {"malformed"}, "wrong-shape": {"wrong-shape"},
    "wrong-dtype": {"wrong-dtype"}, "non-finite": {"non-finite"}, "garbage": {"malformed"},
    "truncated": {"malformed"}, "other-stype": {"malformed"}, "npz": {"malformed"},
    "huge-shape": {"malformed", "wrong-shape"}, "huge-payload": {"wrong-shape"},
    "error": {f"error-code-{c}" for c in range(0, 1000)}, "empty": {"malformed"}, "wrong-type": {"wrong-type"},
}
VALID = ("valid", "valid-reordered", "valid-renamed-record", "valid-odd-metrics", "valid-hostile-metrics",
         "valid-extreme", "valid-float-width")
#: What a valid reply may also be rejected as: an update of 1e30 or 1e200 among updates of about 1 is
#: an outlier (unless it is the run's first, which has nothing to be compared with).
VALID_REASONS = {"valid-extreme": {"outlier"}}
#: Metrics a ClientApp could send (some only in-process, past MetricRecord's type check).
HOSTILE_METRICS = [("compute-time", 1e9), ("compute-time", math.nan), ("compute-time", -5.0), ("num-examples", 2.5),
                   ("num-examples", math.inf), ("num-examples", -1), ("$array", 1.0), ("$bytes", [1.0]),
                   ("text", "abc"), ("flag", True), ("huge", 10**400), ("mixed", [1.0, "a"]), ("nan-list", [math.nan]),
                   ("loss", -math.inf), ("ok-list", [0.5, 2]), ("ok", 3)]
KINDS = VALID + tuple(REASONS)

SINGLE = {"model": np.linspace(-1.0, 1.0, 6)}  # one float64 array: the hot path
LAYERED = {"conv.weight": np.arange(6, dtype=np.float32).reshape(2, 3) / 10, "conv.bias": np.zeros(3, np.float32),
           "bn.num_batches_tracked": np.array(7, dtype=np.int64), "fc.weight": np.ones((3, 2), np.float32)}
SETUPS = {
    "rescaled-gradient": (SINGLE, lambda: RescaledASGD(lr=0.05)),
    "rescaled-model": (LAYERED, lambda: RescaledASGD(lr=0.05, reply="model")),
    "fedbuff-model": (LAYERED, lambda: FedBuff(buffer_size=2)),
    "malenia-gradient": (LAYERED, lambda: MaleniaSGD(lr=0.05)),
}
WALL_SETUPS = {
    "rescaled-wall": (SINGLE, lambda: RescaledASGD(lr=0.05)),
    "malenia-wall": (LAYERED, lambda: MaleniaSGD(lr=0.05)),
}
SETUPS.update(WALL_SETUPS)

reply_plans = st.dictionaries(st.integers(0, 14), st.tuples(st.sampled_from(KINDS), st.integers(0, 2**32 - 1)),
                              max_size=10)
extras = st.lists(st.tuples(st.integers(0, 14), st.sampled_from(["duplicate", "stray"])), max_size=4)


def _values(template: dict[str, np.ndarray], rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
    out = {}
    for k, a in template.items():
        if a.dtype.kind == "f":
            out[k] = (rng.uniform(-1, 1, a.shape) * scale).astype(a.dtype)
        else:
            out[k] = a.copy()
    return out


def build_reply(msg: Message, kind: str, seed: int, reply: str) -> Message:
    """The reply of drawn ``kind`` to job message ``msg``."""
    rng = np.random.default_rng(seed)
    sent = {k: np.array(v.numpy()) for k, v in msg.content["arrays"].items()}
    floats = [k for k, a in sent.items() if a.dtype.kind == "f"]
    # valid-extreme: finite values whose squares overflow the float type (the finiteness check's slow
    # path), small enough that a few steps keep the model finite.
    g = _values(sent, rng, 1.0) if kind != "valid-extreme" else {
        k: (rng.uniform(-1, 1, a.shape) * (1e30 if a.dtype == np.float32 else 1e200)).astype(a.dtype)
        if a.dtype.kind == "f" else a for k, a in sent.items()}
    values = g if reply == "gradient" else {k: (sent[k] - 0.1 * g[k] if k in floats else sent[k]) for k in sent}
    if reply == "gradient" and len(sent) > 1 and rng.random() < 0.5:  # a gradient may leave the counters out
        values = {k: v for k, v in values.items() if k in floats}
    metrics = {"loss": float(rng.random()), "num-examples": int(rng.integers(1, 100))}
    arrays = {k: encode_array(v) for k, v in values.items()}
    record_name = "arrays"
    content = RecordDict()
    target = floats[int(rng.integers(len(floats)))]

    if kind == "valid-reordered":
        arrays = dict(reversed(list(arrays.items())))
    elif kind == "valid-renamed-record":
        record_name = "r" + str(rng.integers(1 << 30))
    elif kind == "valid-odd-metrics":
        metrics = {"loss": float("nan"), "num-examples": -3, "acc": float("inf"), "x": [1.0, float("nan")],
                   "n": 2**63 - 1, "compute-time": -1.0}
        content["cfg"] = ConfigRecord({"note": "hello", "n": 2**62})
    elif kind == "valid-hostile-metrics":
        picks = rng.choice(len(HOSTILE_METRICS), size=int(rng.integers(1, 6)), replace=False)
        metrics = {}
        content["cfg"] = ConfigRecord({"compute-time": "abc"})
    elif kind == "valid-float-width":  # float64 for a float32 array and float32 for a float64 one: cast
        arrays.update({k: encode_array(values[k].astype(np.float64 if values[k].dtype == np.float32 else np.float32))
                       for k in floats})
    elif kind == "key-renamed":
        arrays[target + "_renamed"] = arrays.pop(target)
    elif kind == "key-missing":
        arrays.pop(target)
    elif kind == "key-extra":
        arrays["extra." + str(rng.integers(1000))] = encode_array(np.ones(2))
    elif kind == "wrong-shape":
        a = values[target]
        bad = a.reshape(-1) if a.ndim > 1 else np.append(a, a[:1])
        if a.ndim == 1 and rng.random() < 0.5:
            bad = a.reshape(1, -1)
        arrays[target] = encode_array(np.ascontiguousarray(bad))
    elif kind == "wrong-dtype":
        choices = ["int32", "int64", "uint8", "bool", "complex64"]  # (a float array of any width is cast)
        with np.errstate(invalid="ignore", over="ignore"):  # (values beyond an integer type: any bits do)
            arrays[target] = encode_array(values[target].astype(choices[int(rng.integers(len(choices)))]))
    elif kind == "non-finite":
        a = values[target].copy().reshape(-1)
        a[int(rng.integers(a.size))] = [np.nan, np.inf, -np.inf][int(rng.integers(3))]
        arrays[target] = encode_array(a.reshape(values[target].shape))
    elif kind == "garbage":
        a = arrays[target]
        arrays[target] = Array(dtype=a.dtype, shape=a.shape, stype=a.stype, data=rng.bytes(len(a.data)))
    elif kind == "truncated":
        a = arrays[target]
        arrays[target] = Array(dtype=a.dtype, shape=a.shape, stype=a.stype, data=a.data[: len(a.data) // 2])
    elif kind == "other-stype":
        a = arrays[target]
        arrays[target] = Array(dtype=a.dtype, shape=a.shape, stype="torch.Tensor", data=a.data)
    elif kind == "npz":
        buf = io.BytesIO()
        np.savez(buf, x=values[target])
        a = arrays[target]
        arrays[target] = Array(dtype=a.dtype, shape=a.shape, stype="numpy.ndarray", data=buf.getvalue())
    elif kind == "huge-shape":  # a header that declares 10^12 elements, with a few bytes behind it
        a = arrays[target]
        arrays[target] = Array(dtype=a.dtype, shape=(10**6, 10**6), stype="numpy.ndarray", data=a.data)
    elif kind == "huge-payload":  # 16 MB where a few bytes are expected
        arrays[target] = encode_array(np.zeros(2 * 1024 * 1024, dtype=values[target].dtype))
    if kind not in ("no-arrays", "empty", "error"):
        content[record_name] = ArrayRecord(arrays)
    if kind == "two-records":
        content["a"] = ArrayRecord(arrays)
        content["b"] = ArrayRecord(arrays)
        del content[record_name]
    if kind != "empty":
        content["metrics"] = MetricRecord(metrics)
    if kind == "valid-hostile-metrics":  # (past MetricRecord's own type check, as an in-process reply can be)
        for i in picks:
            key, value = HOSTILE_METRICS[int(i)]
            content["metrics"]._data[key] = value
    if kind == "error":
        out = Message(Error(code=int(rng.integers(0, 1000)), reason=str(rng.bytes(8))), reply_to=msg)
    else:
        out = Message(content, reply_to=msg)
    if kind == "wrong-type":
        out.metadata.__dict__["_message_type"] = "evaluate"
    return out


def _never(msg, context):  # the Grid below answers every job itself
    raise AssertionError("the ClientApp should not be called")


class FuzzGrid(InProcessGrid):
    """Answers job number j with the reply ``plan[j]`` describes (valid when absent); slips in a
    duplicate of, or a stray reply next to, the reply of the jobs ``extras`` names. ``threaded``: one
    thread per node (the wall clock), node i taking (i + 1) ms per job."""

    def __init__(self, plan, extras, reply, threaded=False):
        app = ClientApp()
        app.train()(_never)
        super().__init__(app, 3, threaded=threaded)
        self.plan, self.extras, self.reply = plan, dict(extras), reply
        self.job_of: dict[str, int] = {}
        self.injected = {"duplicate": 0, "unknown-job": 0}
        self.answered: list[int] = []  # the job of every training reply handed over, in order

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        for mid, msg in zip(ids, messages):
            if msg.metadata.message_type == "train":
                self.job_of[mid] = int(msg.content["config"]["job-id"])
        return ids

    def _execute(self, msg):
        if self.threaded:
            time.sleep(0.001 * (1 + self.node_ids.index(msg.metadata.dst_node_id)))
        if msg.metadata.message_type != "train":  # federated evaluation: a plain answer
            rep = Message(RecordDict({"metrics": MetricRecord({"loss": 0.5, "num-examples": 10})}), reply_to=msg)
            rep.metadata.__dict__["_message_id"] = f"r{msg.metadata.message_id}"
            return rep
        job = int(msg.content["config"]["job-id"])
        kind, seed = self.plan.get(job, ("valid", job))
        rep = build_reply(msg, kind, seed, self.reply)
        rep.metadata.__dict__["_message_id"] = f"r{msg.metadata.message_id}"
        return rep

    def pull_messages(self, message_ids):
        out = []
        for rep in super().pull_messages(message_ids):
            out.append(rep)
            if rep.metadata.reply_to_message_id in self.job_of:  # (a training job's, whatever its type says)
                self.answered.append(self.job_of[rep.metadata.reply_to_message_id])
            extra = self.extras.get(self.job_of.get(rep.metadata.reply_to_message_id, -1))
            if extra == "duplicate":
                out.append(rep)
                self.injected["duplicate"] += 1
            elif extra == "stray":
                stray = Message(RecordDict(dict(rep.content)) if rep.has_content() else RecordDict(),
                                reply_to=Message(RecordDict(), self.node_ids[0], "train"))
                stray.metadata.__dict__["_reply_to_message_id"] = "never-sent"
                out.append(stray)
                self.injected["unknown-job"] += 1
        return out


def clean_metrics(metrics: dict) -> bool:
    """Every metric a finite number or a list of them; a count a non-negative int; a time ≥ 0."""
    def number(v):
        return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    for key, v in metrics.items():
        if key.startswith("$"):
            return False
        if not (all(number(x) for x in v) if isinstance(v, list) else number(v)):
            return False
    ok_count = "num-examples" not in metrics or (type(metrics["num-examples"]) is int and metrics["num-examples"] >= 0)
    return ok_count and metrics.get("compute-time", 0.0) >= 0


def fuzz_run(setup: str, plan, extras) -> list[str]:
    template, make = SETUPS[setup]
    s = make()
    wall = setup.endswith("-wall")
    grid = FuzzGrid(plan, extras, s.reply, threaded=wall)
    events = []
    prev = {"x": None}

    def on_event(comp, x):
        manager = run_of(s).manager  # (set aside by this rejection: a round may close without it)
        aside = manager.books.strikes[comp.worker] == SET_ASIDE_AFTER and not manager.is_online(comp.worker)
        events.append((comp.job.job_id, comp.rejected, prev["x"], x.copy(), dict(comp.metrics), aside))
        prev["x"] = x.copy()

    initial = ArrayRecord({k: Array(v) for k, v in template.items()})
    clock = WallClock(0.001) if wall else VirtualClock(DelayModel([1.0, 2.0, 3.0]))
    try:
        start_run(s, grid, initial, time_budget=WALL_BUDGET if wall else 10, clock=clock, observers=[OnEvent(on_event)])
    except RunFailed as exc:
        assert "cannot make progress" in str(exc)
    finally:
        grid.close()
    seen = []
    for job, rejected, before, after, metrics, aside in events:
        kind = plan.get(job, ("valid", 0))[0]
        seen.append(f"{kind} -> {'error-code-N' if (rejected or '').startswith('error-code') else rejected or 'applied'}")
        if kind in VALID and rejected is None:
            assert clean_metrics(metrics), (setup, job, kind, metrics)
        elif kind in VALID:
            assert rejected in VALID_REASONS.get(kind, ()), (setup, job, kind, rejected,
                                                             run_of(s).manager.books.first_failure)
        else:
            assert rejected in REASONS[kind], (setup, job, kind, rejected)
        if rejected is not None and before is not None and not aside:
            assert before.tobytes() == after.tobytes(), (setup, job, kind)
    # Every reply the Grid handed over reached the strategy once: applied, or rejected with a reason
    # (checked above). A reply dropped without a completion would be missing here.
    # (Wall clock: a reply pulled for a job cancelled meanwhile, or after the budget ran out, is not a
    # completion; every completion is still one reply handed over, once.)
    handled = [job for job, *_ in events]
    if wall:
        assert len(set(handled)) == len(handled) and set(handled) <= set(grid.answered), (setup, handled)
    else:
        assert sorted(handled) == sorted(grid.answered), (setup, handled, grid.answered)
    books = run_of(s).manager.books
    failed = sum(1 for _, rejected, *_ in events if rejected is not None)
    assert sum(books.failures().values()) == failed, (setup, books.failures(), failed)
    assert books.stray.get("duplicate", 0) == grid.injected["duplicate"]
    assert books.stray.get("unknown-job", 0) == grid.injected["unknown-job"]
    assert all(r["balanced"] for r in books.balance())
    return seen


@pytest.mark.parametrize("setup", [name for name in SETUPS if name not in WALL_SETUPS])
@fuzz(REPLIES_PER_SETUP)
@given(plan=reply_plans, extras=extras)
def test_only_a_valid_reply_moves_the_model(setup, plan, extras):
    for what in fuzz_run(setup, plan, extras):  # (statistics: pytest --hypothesis-show-statistics)
        event(what)


@pytest.mark.parametrize("setup", list(WALL_SETUPS))
@fuzz(WALL_REPLIES_PER_SETUP)
@given(plan=reply_plans, extras=extras)
def test_only_a_valid_reply_moves_the_model_on_the_wall_clock(setup, plan, extras):
    for what in fuzz_run(setup, plan, extras):
        event(what)


# ================================================================================ flags and keys
def _all_flags() -> dict[str, str]:
    """Every long flag of ``run_sim.py`` and its kind (``store_true`` flags: "bool")."""
    out = {}
    for action in cli.build_parser()._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                out[flag] = "bool" if action.nargs == 0 else "value"
    return out


FLAGS = _all_flags()
numbers = st.one_of(st.integers(-10**30, 10**30), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, -1, 2**63, 1e-320, 1e308, -0.0]))
texts = st.one_of(
    numbers.map(str),
    st.lists(numbers, min_size=1, max_size=4).map(lambda v: ",".join(map(str, v))),
    st.sampled_from(["", " ", "none", "None", "nan", "inf", "-inf", "true", "false", "1,", ",", "1,,2",
                     "rescaled", "fedbuff", "quadratic", "mnist", "wall", "virtual", "exponential", "fixed",
                     "interval", "compute", "model", "gradient", "0x10", "1_000", "½", "١٢", "--budget"]),
    st.text(max_size=8),
)
argvs = st.lists(st.one_of(
    st.tuples(st.sampled_from(sorted(FLAGS)), texts),
    st.tuples(st.sampled_from(["--bugdet", "--x", "-q", "paper-", "--"]), texts),
), max_size=6)


def _one_line(text: str) -> bool:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return len(lines) == 1 and "Traceback" not in text


def _argv(pairs) -> list[str]:
    argv = []
    for flag, value in pairs:
        argv.append(flag)
        if FLAGS.get(flag) != "bool":
            argv.append(value)
    return argv


@fuzz(FLAG_CASES)
@given(pairs=argvs)
def test_any_command_line_parses_or_exits_2_with_one_line(pairs):
    argv = _argv(pairs)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            _, specs = cli.parse(argv)
        except SystemExit as exc:
            assert exc.code == 2 and _one_line(err.getvalue()), (argv, exc.code, err.getvalue())
            return
    for spec in specs:  # a run that parses is a valid one
        assert spec.budget > 0 and math.isfinite(spec.budget) and len(spec.taus) == spec.num_clients
        assert all(t > 0 and math.isfinite(t) for t in spec.taus)


CONFIG_KEYS = sorted(run_config_keys())
config_values = st.one_of(numbers, st.booleans(), texts, st.lists(numbers, max_size=3))
option_strings = st.lists(
    st.tuples(st.sampled_from(sorted({o.key for name in STRATEGIES for o in options.common_options()
                                       + options.strategy_options(name)} | {"nope"})), texts),
    max_size=3).map(lambda kv: " ".join(f"{k}={v}" for k, v in kv))
run_configs = st.dictionaries(
    st.one_of(st.sampled_from(CONFIG_KEYS), st.text(max_size=6)),
    st.one_of(config_values, option_strings), max_size=6)


def _resolve(cfg):
    """The run a config gives, or the text of the ValueError it raises."""
    from fl_rescaled.experiment import resolve

    try:
        return resolve(spec_from_run_config(cfg))
    except ValueError as exc:
        return str(exc)


def named_keys(cfg: dict, message: str) -> list[str]:
    """The keys of ``cfg`` that ``message`` names: as ``--key``, ``'key'`` or the word ``key`` (an
    option inside ``strategy-options`` names that key)."""
    import re

    def names(text: str) -> bool:
        return (f"--{text}" in message or repr(text) in message
                or (text != "" and re.search(rf"(?<![\w-]){re.escape(text)}(?![\w-])", message) is not None))

    found = [k for k in cfg if names(k)]
    options_given = {item.split("=", 1)[0] for item in str(cfg.get(STRATEGY_OPTIONS_KEY, "")).split()} - {""}
    return found + [STRATEGY_OPTIONS_KEY] * (STRATEGY_OPTIONS_KEY not in found and any(map(names, options_given)))


@fuzz(CONFIG_CASES)
@given(cfg=run_configs)
def test_any_run_config_gives_a_run_or_one_line_naming_the_key(cfg):
    outcome = _resolve(cfg)
    if isinstance(outcome, str):
        assert _one_line(outcome), (cfg, outcome)
        named = named_keys(cfg, outcome)
        assert named, f"the error names none of the keys {sorted(cfg)}: {outcome}"
        # ... and the key it names is the one at fault: without it the answer changes.
        assert _resolve({k: v for k, v in cfg.items() if k not in named}) != outcome, (cfg, outcome)
        return
    spec = outcome
    assert spec.budget > 0 and math.isfinite(spec.budget) and len(spec.taus) == spec.num_clients


#: Flags whose drawn values would only make a run slow (or wait on the wall clock) in the
#: end-to-end cases below; the parsing test above covers them. What is left runs 30 simulated time
#: units with at most 4 clients, so every case ends (no time limit here: tests assert no timings).
COSTLY = {"--task", "--engine", "--data-dir", "--out", "--resume", "--checkpoint-every", "--clock", "--time-unit",
          "--emulate", "--ttl", "--workers", "--torch-threads", "--quad-dim", "--local-steps", "--num-clients",
          "--taus", "--budget", "--eval-every", "--verbose", "--ahead", "--batch-size", "--strategy"}
cheap_argvs = st.tuples(
    st.lists(st.tuples(st.sampled_from(sorted(set(FLAGS) - COSTLY)), texts), max_size=4),
    st.sampled_from(["rescaled", "vanilla", "fedasync", "fedbuff", "malenia", "ringleader", "concurrent",
                     "minibatch", "delay-adaptive"]),
    st.integers(1, 4),
)


def _exit_code(fn, argv) -> tuple[int, str]:
    """``fn(argv)``'s exit status (returned or raised) and its stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = fn(argv)
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()


@fuzz(MAIN_CASES)
@given(case=cheap_argvs)
def test_any_cheap_command_line_runs_or_fails_in_one_line(case):
    pairs, strategy, n = case
    argv = [*_argv(pairs), "--task", "quadratic", "--strategy", strategy, "--num-clients", str(n),
            "--budget", "30", "--eval-every", "10", "--workers", "1", "--json", "--no-progress"]
    parsed, _ = _exit_code(lambda a: cli.parse(a) and 0, argv)
    code, err = _exit_code(cli.main, argv)
    event(f"exit {code}")
    assert code in (0, 1, 2), (argv, code, err)
    if code:
        assert _one_line(_errors(err)), (argv, code, err)
    # Exit 2 exactly for the command lines parsing refuses; a command line that parses runs to its
    # budget (exit 0) unless its run diverged (non-finite gradients, or its loss exploded), a flag took
    # away what the project's ClientApp reads, or it made no update at all (exit 1, the run's loud failure).
    assert (code == 2) == (parsed == 2), (argv, code, parsed, err)
    if code == 1:
        assert "cannot make progress" in err or "the model diverged" in err, (argv, err)
        assert ("non-finite" in err or "applied no update" in err or "the model diverged" in err
                or any(flag in argv and why in err for flag, why in CLIENT_NEEDS.items())), (argv, err)


def _errors(err: str) -> str:
    """stderr without its warning lines (a flag that does not apply, a client whose replies were all
    rejected, numpy's overflow in a client: each one line), leaving what ended the run."""
    return "\n".join(ln for ln in err.splitlines() if not ln.startswith("run_sim.py: warning: "))


#: The values issue 21 tried at every flag (an empty value, the smallest and largest floats, a
#: negative, NaN, inf, text, a list with an empty item, an integer beyond int64).
ISSUE_VALUES = ["", "5e-324", "1e300", "1e308", "-1", "nan", "inf", "abc", "1,,2", "99999999999999999999"]
#: Flags that act on the wall clock only: tried on it (a 50 ms budget), the others on the virtual one.
WALL_FLAGS = {"--time-unit", "--emulate", "--ttl", "--tau-estimator", "--tau-smoothing", "--poll-interval",
              "--node-refresh"}
HANG_SECONDS = 30  # a case still running after this long has hung (no run here needs a second)
VALUE_FLAGS = sorted(f for f, kind in FLAGS.items() if kind == "value")
ISSUE_CASES = len(ISSUE_VALUES) * len(VALUE_FLAGS)
FUZZ_CASES = (4 * REPLIES_PER_SETUP + 2 * WALL_REPLIES_PER_SETUP + FLAG_CASES + CONFIG_CASES + MAIN_CASES
              + ISSUE_CASES)


class Hung(Exception):
    pass


@pytest.mark.parametrize("flag", VALUE_FLAGS)
def test_every_flag_takes_every_value_of_the_issue_without_a_traceback_or_a_hang(flag, tmp_path, monkeypatch):
    """Each value at each flag, on a short quadratic run through ``cli.main``: exit 0, 1 or 2; a
    refusal or failure in one line (warnings aside); never a traceback; never a hang (an alarm
    stops a case that runs past ``HANG_SECONDS``)."""
    import signal

    monkeypatch.chdir(tmp_path)  # (--out and --resume values are folders, made here)
    base = ["--task", "quadratic", "--taus", "1,2", "--budget", "20", "--workers", "1", "--no-progress", "--json",
            "--strategy", next((name for name in STRATEGIES if flag.startswith(f"--{name}-")), "rescaled")]
    if flag in WALL_FLAGS:
        base += ["--clock", "wall", "--time-unit", "0.002", "--budget", "25"]

    def hung(*_):
        raise Hung()

    previous = signal.signal(signal.SIGALRM, hung)
    try:
        for value in ISSUE_VALUES:
            argv = [*base, flag, value]
            signal.setitimer(signal.ITIMER_REAL, HANG_SECONDS)
            try:
                code, err = _exit_code(cli.main, argv)
            except Hung:
                pytest.fail(f"hung: {argv}")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            assert code in (0, 1, 2) and "Traceback" not in err, (argv, code, err)
            if code:
                assert _one_line(_errors(err)), (argv, code, err)
            if code == 1:
                assert "cannot make progress" in err or "the model diverged" in err, (argv, err)
    finally:
        signal.signal(signal.SIGALRM, previous)


#: Flags that take away what the project's ClientApp needs, and how its replies then fail: it reads
#: the job's config from the ConfigRecord named "config" (it raises: Flower's error code 2).
CLIENT_NEEDS = {"--configrecord-key": "error-code-2"}


# ================================================================================ what fuzzing found
# Each of these failed before its fix (a traceback, a hang, or a bad reply that got in).
@pytest.mark.parametrize("setup,kind", [
    ("rescaled-gradient", "npz"),  # np.load returned an NpzFile: AttributeError out of the manager
    ("rescaled-model", "huge-shape"),  # bytes of the right array under a declared 10^12-element shape: applied
    ("rescaled-gradient", "wrong-type"),  # an "evaluate" reply to a train job: applied
])
def test_found_a_reply_that_got_in_or_crashed(setup, kind):
    fuzz_run(setup, {0: (kind, 0)}, [])


@pytest.mark.parametrize("argv,message", [
    (["--bugdet", "\r0"], "unrecognized arguments: --bugdet \\r0"),  # a line break in the one line
    (["--num-clients", "2049", "--task", "quadratic"], None),  # default τ overflowed a float: OverflowError
    (["--num-clients", str(10**9)], "--num-clients must be in 1..1,000,000"),
    (["--budget", "nan"], "--budget: expected a finite number"),
    (["--lr", "inf"], "--lr: expected a finite number"),
    (["--eval-every", "1e-300"], "more than 1,000,000 evaluations"),  # ran for ever
    (["--seed", "-1"], "--seed must be in 0.."),  # numpy's ValueError, with a traceback, mid-run
    (["--jobs-per-node", str(10**30)], "jobs_per_node must be an integer in 1..1000"),  # sent jobs for ever
    (["--strategy", "concurrent", "--concurrent-seed", "-1"], "seed must be a non-negative integer"),
])
def test_found_a_flag_that_crashed_or_hung(argv, message):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            _, specs = cli.parse(argv)
        except SystemExit as exc:
            assert exc.code == 2 and _one_line(err.getvalue()) and message and message in err.getvalue(), err.getvalue()
            return
    assert message is None, specs
    assert max(specs[0].taus) / min(specs[0].taus) == 16

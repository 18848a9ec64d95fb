"""Same seed, same run: the in-process Grid and Flower's Simulation Engine (Ray) give one trajectory.

On the virtual clock the client manager hands completions over in simulated-time order whatever
order the transport delivers replies in, and every job's randomness comes from (seed, partition
id, job number). So a run on Flower's engine must end at the same model, with the same books, as
the same run on the in-process Grid. One simulation (one Ray start) runs all the Flower-side
experiments of this module; each test then runs its in-process twin and compares.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager

# (conftest.py sets the offline/quiet Flower and Ray environment before anything imports flwr)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from conftest import fedbuff_rule, local_steps_factor, mnist_cache_path, replay, run_of, start_run  # noqa: E402
from fl_rescaled import experiment  # noqa: E402
from fl_rescaled.experiment import RunSpec  # noqa: E402

pytestmark = pytest.mark.slow

# Three clients with heterogeneous mean compute times, exponential delays, noisy gradients.
_QUAD = dict(task="quadratic", lr=0.2, delays="exponential", taus=[1.0, 2.0, 5.0], quad_a=[1.0, 2.0, 0.5],
             quad_b=[3.0, -1.0, 2.0], quad_dim=4, noise=0.5, seed=7, eval_every=2.0)
QUAD_SPECS = {
    # stepsize from each gradient's delay: ~50 updates
    "delay-adaptive": RunSpec(strategy="delay-adaptive", budget=28.0, **_QUAD),
    # a table of the workers' latest gradients, rounds of at least one gradient each
    "ringleader": RunSpec(strategy="ringleader", budget=30.0, **_QUAD),
    # rounds that cancel the jobs still running (their replies must be ignored on any transport)
    "malenia": RunSpec(strategy="malenia", budget=20.0, **_QUAD),
    # a population: 3 of 8 clients training at a time, drawn when a slot frees, lognormal speeds,
    # clients going offline (jobs lost) and coming back
    "population": RunSpec(task="quadratic", strategy="rescaled", options={"concurrency": 3}, num_clients=8,
                          delays="lognormal", availability="daily", availability_period=10.0, lr=0.2, noise=0.5,
                          quad_dim=2, seed=5, budget=30.0, eval_every=5.0),
}
# Ten clients, harmonic τ = 1,1,2,2,...,16,16 (fixed): ~20 updates; evaluated at 0 and at the end.
MNIST_SPEC = RunSpec(task="mnist", strategy="rescaled", lr=0.5, num_clients=10, budget=6.0, eval_every=6.0, seed=1)


@contextmanager
def final_models():
    """Record the model each ``experiment.run`` evaluates last (its final model), in run order."""
    models: list[dict[str, np.ndarray]] = []
    original = experiment.make_evaluate_fn

    def patched(task):
        evaluate = original(task)
        slot: dict[str, np.ndarray] = {}
        models.append(slot)

        def wrapped(step, arrays):
            slot["x"] = np.concatenate([a.numpy().reshape(-1) for a in arrays.values()])
            return evaluate(step, arrays)

        return wrapped

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(experiment, "make_evaluate_fn", patched)
        yield models


def in_process(spec: RunSpec) -> tuple[dict, np.ndarray]:
    with final_models() as models:
        outcome = experiment.run(spec)
    return outcome, models[0]["x"]


@pytest.fixture(scope="module")
def flower_runs(request) -> dict[str, tuple[dict, np.ndarray]]:
    """All of this module's runs on Flower's Simulation Engine, in one simulation."""
    from fl_rescaled.flower_sim import run_many_on_flower

    specs = dict(QUAD_SPECS)
    if mnist_cache_path() is not None:  # (without it the MNIST test fails or, if allowed, skips itself)
        specs["mnist"] = MNIST_SPEC
    with pytest.MonkeyPatch.context() as mp, final_models() as models:
        mp.setattr("flwr.supercore.telemetry.FLWR_TELEMETRY_ENABLED", "0")  # even if flwr was imported earlier
        outcomes = run_many_on_flower(list(specs.values()), num_cpus=2)
    return {name: (out, m["x"]) for name, out, m in zip(specs, outcomes, models, strict=True)}


def assert_same_run(ref: dict, ref_x: np.ndarray, out: dict, x: np.ndarray, atol: float = 0.0) -> None:
    assert out["engine"] == "flower"
    assert out["num_updates"] == ref["num_updates"] > 0
    assert out["updates_per_worker"] == ref["updates_per_worker"]
    assert out["discarded_per_worker"] == ref["discarded_per_worker"]
    assert out["lost_per_worker"] == ref["lost_per_worker"]  # (offline clients only: nothing else is lost)
    assert out["rejected"] == ref["rejected"] and set(ref["rejected"]) <= {"offline"}
    assert out["final_time"] == ref["final_time"]
    np.testing.assert_allclose(out["cumulative_stepsize"], ref["cumulative_stepsize"], rtol=1e-12)
    assert [h["time"] for h in out["history"]] == [h["time"] for h in ref["history"]]
    assert [h["updates"] for h in out["history"]] == [h["updates"] for h in ref["history"]]
    np.testing.assert_allclose([h["loss"] for h in out["history"]], [h["loss"] for h in ref["history"]], rtol=1e-6)
    assert x.shape == ref_x.shape
    np.testing.assert_allclose(x, ref_x, rtol=1e-6, atol=atol)


@pytest.mark.parametrize("strategy", list(QUAD_SPECS))
def test_quadratic_same_trajectory_on_flower(flower_runs, strategy):
    spec = QUAD_SPECS[strategy]
    ref, ref_x = in_process(spec)
    out, x = flower_runs[strategy]
    assert_same_run(ref, ref_x, out, x)
    np.testing.assert_allclose(out["final_params"], ref["final_params"], rtol=1e-6)
    assert ref["num_updates"] >= 5
    if strategy == "delay-adaptive":
        assert ref["num_updates"] >= 30
        assert len(set(ref["updates_per_worker"])) == 3  # heterogeneous workers really did differ
    if strategy == "malenia":
        assert sum(ref["discarded_per_worker"]) > 0  # cancelled jobs whose replies were ignored


@pytest.mark.mnist
def test_mnist_same_trajectory_on_flower(mnist_cache, flower_runs):
    del mnist_cache
    ref, ref_x = in_process(MNIST_SPEC)
    out, x = flower_runs["mnist"]
    assert ref["num_updates"] >= 15
    # float32 model, bit for bit: the in-process run computes every job on one torch thread, as the
    # Ray actors do (with torch's default two threads in process, 21 of the 101,770 weights differed).
    np.testing.assert_array_equal(x, ref_x)  # both sides run every job on one torch thread
    assert x.size == 101_770  # the paper's MLP, 784-128-10
    assert out["data_source"] == ref["data_source"]


def test_failing_server_app_raises_a_clear_error():
    """An exception inside the ServerApp ends the simulation and surfaces as FlowerRunError."""
    from fl_rescaled import flower_sim

    def boom(spec, grid):
        raise RuntimeError("deliberate ServerApp failure")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("flwr.supercore.telemetry.FLWR_TELEMETRY_ENABLED", "0")
        mp.setattr(flower_sim, "run", boom)
        with pytest.raises(flower_sim.FlowerRunError, match="deliberate ServerApp failure") as info:
            flower_sim.run_on_flower(RunSpec(task="quadratic", num_clients=2, budget=1.0))
    assert isinstance(info.value.__cause__, RuntimeError)


def test_invalid_spec_fails_before_ray_starts():
    from fl_rescaled.flower_sim import run_on_flower

    with pytest.raises(ValueError, match="unknown strategy"):
        run_on_flower(RunSpec(task="quadratic", strategy="nope"))


def test_a_user_app_on_flowers_engine_gets_its_context_and_run_config():
    """``run_on_flower_engine`` gives the ServerApp a Context and every ClientApp the run config
    (Flower's ``run_simulation`` leaves both empty), and a drop-in strategy runs there on the wall
    clock with time-proportional weights from online τ estimates."""
    from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    from fl_rescaled import FedBuff
    from fl_rescaled.flower_sim import run_on_flower_engine

    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        w = msg.content["arrays"]["w"].numpy()
        target = float(context.run_config["target"])  # from the run config, on every node
        # One local step of lr on (w − target)²: the update w − y is 2·lr·(w − target).
        y = w - float(msg.content["config"]["lr"]) * 2 * (w - target)
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(y)}),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    server = ServerApp()
    seen = {}

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        seen["run_config"] = dict(context.run_config)
        strategy = FedBuff(buffer_size=2, fraction_evaluate=0.0)
        result = start_run(strategy, grid=grid, initial_arrays=ArrayRecord({"w": Array(np.zeros(2))}),
                                train_config={"lr": LR}, num_updates=int(context.run_config["updates"]))
        seen["result"], seen["clock"] = result, run_of(strategy).manager.clock

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("flwr.supercore.telemetry.FLWR_TELEMETRY_ENABLED", "0")
        run_on_flower_engine(server, client, 2, run_config={"target": 3.0, "updates": 4})
    assert seen["run_config"] == {"target": 3.0, "updates": 4}
    result = seen["result"]
    assert result.books["updates"] == 4 and result.books["rejected"] == 0
    assert not seen["clock"].virtual  # Flower's runtimes: the wall clock by default
    # Where FedBuff (K = 2, p = 1/2) can be after 4 server updates from 0: on the wall clock the
    # replies come in any order, so the test computes FedBuff's end for every order of the 8
    # completions the 4 updates take (2 workers, one job each: 2^8 orders, conftest.replay) and the
    # run must end on one of those points (float64 throughout; 1e-12 is rounding). With lr = 0.05
    # (each update is a tenth of the distance to 3) they lie in [0.958, 1.032]; summing the buffer
    # instead of averaging it puts every end in [1.71, 1.78], dropping every other update in
    # [0.45, 0.56].
    w = result.arrays["w"].numpy()
    ends = fedbuff_ends(updates=4)
    assert min(abs(w[0] - e) for e in ends) < 1e-12, (w, sorted(ends))
    assert w[1] == w[0]


LR = 0.05


def fedbuff_ends(updates: int) -> set[float]:
    """Every model FedBuff(buffer_size=2) can end on after ``updates`` server updates of the two
    clients above, over all the orders in which their replies can come."""
    rule = fedbuff_rule(2, 0.5)
    c = local_steps_factor(LR, 1)
    return {replay(order, [3.0, 3.0], c, rule, steps=updates)
            for order in itertools.product((0, 1), repeat=2 * updates)}


def test_the_clientapps_own_exception_text_reaches_run_failed_on_the_engine():
    """On the Simulation Engine an error reply's reason is a Ray traceback whose last line is only
    Flower's wrapper (``ClientAppException:``); the run names the ClientApp's own exception."""
    from flwr.app import Array, ArrayRecord, Context, Message
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    from fl_rescaled import FedBuff, RunFailed
    from fl_rescaled.flower_sim import FlowerRunError, run_on_flower_engine

    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        raise KeyError(str(msg.content["config"].get("missing", "learning-rate")))

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        FedBuff(buffer_size=2, fraction_evaluate=0.0).start(
            grid=grid, initial_arrays=ArrayRecord({"w": Array(np.zeros(2))}), train_config={"lr": 0.25},
            num_updates=4)

    with pytest.MonkeyPatch.context() as mp, pytest.raises(FlowerRunError) as info:
        mp.setattr("flwr.supercore.telemetry.FLWR_TELEMETRY_ENABLED", "0")
        run_on_flower_engine(server, client, 2)
    assert isinstance(info.value.__cause__, RunFailed)
    assert "error-code-2): KeyError: 'learning-rate'" in str(info.value.__cause__)

"""Wall-clock mode: arrival order, online τ estimates, nodes that leave and come back.

These runs use the in-process Grid in threaded mode (one thread per node, replies pulled when
ready) with emulated compute times: the clients sleep τ_i × time-unit seconds per job.
"""

import threading
import time

import numpy as np
from flwr.app import Array, ArrayRecord

from clients.client_app import app
from fl_rescaled import InProcessGrid, RescaledASGD, WallClock
from fl_rescaled.experiment import RunSpec, run
from fl_rescaled.tasks import task_spec

B = [0.0, 3.0, 6.0]


def wall(strategy, **kw):
    spec = dict(task="quadratic", strategy=strategy, taus=[1, 2, 4], quad_a=[1, 1, 1], quad_b=B, lr=0.05,
                budget=200, clock="wall", time_unit=0.02, emulate="fixed", eval_every=50)
    spec.update(kw)
    return run(RunSpec(**spec))


def test_rescaled_online_tau_is_unbiased_vanilla_is_frequency_weighted():
    r, v = wall("rescaled"), wall("vanilla")
    counts = v["updates_per_worker"]
    freq_point = float(np.dot(counts, B) / np.sum(counts))  # where the observed frequencies pull Vanilla
    assert counts[0] > counts[1] > counts[2] > 0
    assert abs(r["final_params"][0] - 3.0) < 0.2
    assert abs(v["final_params"][0] - freq_point) < 0.2
    assert abs(v["final_params"][0] - 3.0) > 1.0


def test_compute_time_estimator_also_works():
    r = wall("rescaled", tau_estimator="compute")
    assert abs(r["final_params"][0] - 3.0) < 0.2


def test_node_that_leaves_and_returns():
    grid = InProcessGrid(app, 3, threaded=True)
    s = RescaledASGD(0.05)
    applied = []
    s.on_event = lambda comp, x: applied.append((time.monotonic(), comp.worker, comp.rejected))
    gone = grid.node_ids[2]

    def outage():
        time.sleep(0.8)
        grid.set_online(gone, False)
        time.sleep(1.0)
        grid.set_online(gone, True)

    t = threading.Thread(target=outage)
    cfg = {"task": "quadratic", "num-partitions": 3, "quad-a": [1.0] * 3, "quad-b": B}
    t0 = time.monotonic()
    t.start()
    try:
        res = s.start(grid, ArrayRecord({"model": Array(np.zeros(1))}), time_budget=200,
                      train_config={"task": task_spec(cfg), "emulate": "fixed", "time-unit": 0.02},
                      clock=WallClock(0.02), timeout=5.0,
                      manager_options={"worker_config": [{"tau": 1.0}, {"tau": 2.0}, {"tau": 4.0}],
                                       "node_refresh": 0.2})
    finally:
        t.join()
        grid.close()
    book = s.manager.books[2]
    assert book.lost >= 1 and s.manager.rejections.get("error-code-5", 0) >= 1
    down = [e for e in applied if e[1] == 2 and e[2] is not None]
    back = [e for e in applied if e[1] == 2 and e[2] is None and e[0] > down[-1][0]]
    assert back, "worker 2 got work again after its node came back"
    assert np.isfinite(res.arrays["model"].numpy()).all()
    assert time.monotonic() - t0 < 10

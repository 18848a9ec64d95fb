"""A run with one hostile node: four nodes, a 3-parameter float32 model, 400 server updates.

Each node i holds f_i(x) = ½‖x − b_i‖² (the b_i within 0.03 of one another, so the optimum of any
three is within 0.02 of the four's) and answers a job with a noisy gradient of it (``reply="gradient"``)
or with the model after three local steps (``reply="model"``). The hostile node answers every job with
an array filled with one value (``1e38``, ``finfo(float32).max``, ``1e30``, ``1e6``, ``1000``) or
with its honest update scaled ×1000 (``x1000``); ``HostileGrid(at=j)`` instead corrupts only the j-th
reply of the run (1e38 in it).

The lying clients (``LIES``) stay inside the outlier guard: each sends a direction d' for its honest
d (a gradient, or the pseudo-gradient x − y of a model reply): the sign flipped and scaled
(``flip1``, ``flip10``, ``flip100``: d' = −k d), the honest update scaled (``x250``: 250 d, under the
guard's 300), a constant direction of norm 1 (``const``: about 30 times an honest norm near the
optimum), a pull toward x = (10, 10, 10) (``target``: an honest client of that optimum) and a slow
drift (``drift``: d plus (j / 500) u in a fixed direction u, j the client's job count).
``HostileGrid(mode, hostile=(…), n=…)`` puts ``n`` nodes (τ and offsets repeating) with several
hostile ones (a quarter of 12: sybils); ``HostileGrid(absent=(…))`` is the run in which those
clients are simply not there. ``PYTHONPATH=. python tests/hostile.py [values...]`` prints the table of
every strategy and value (the distance of the final model to the honest run's, updates, rejections
by reason; ``FAILED``: the run stopped with ``RunFailed``).
"""

from __future__ import annotations

import sys

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_rescaled import DelayModel, InProcessGrid, RunFailed, VirtualClock, add_partition_query
from fl_rescaled.strategies import STRATEGIES

N, DIM, UPDATES = 4, 3, 400
TAUS = [1.0, 1.3, 1.7, 2.2]
HOSTILE_NODE = 2
B = np.array([1.0, -0.5, 0.25])
OFFSETS = np.array([[0.02, 0.0, -0.01], [-0.01, 0.02, 0.0], [0.0, -0.02, 0.01], [-0.01, 0.0, 0.0]])
NOISE = 0.02
LOCAL_STEPS, LOCAL_LR = 3, 0.3
VALUES = {"1e38": 1e38, "f32max": float(np.finfo(np.float32).max), "1e30": 1e30, "1e6": 1e6, "1000": 1000.0}
MODES = [*VALUES, "x1000"]
LIES = ["flip1", "flip10", "flip100", "x250", "const", "target", "drift"]
#: Lies that try to stay under the suspicion rule: honest for 30 jobs, then ×10 flips (``late10``);
#: ×10 flips on every other job (``alt10``); a ×1.4 flip, under the clip (``flip1.4``); × 250 on
#: every third job (``third250``).
SLY = ["late10", "alt10", "flip1.4", "third250"]
TARGET = np.full(DIM, 10.0)
U = np.ones(DIM) / np.sqrt(DIM)


def offsets(n: int) -> np.ndarray:
    """Node i's offset of b: ``OFFSETS`` for the first four, then seeded draws within 0.02."""
    extra = np.random.default_rng(7).uniform(-0.02, 0.02, (max(0, n - N), DIM))
    return np.vstack([OFFSETS, extra])[:n]


def taus(n: int) -> list[float]:
    """The nodes' compute times: ``TAUS`` repeating."""
    return [TAUS[i % N] for i in range(n)]


def honest_update(x: np.ndarray, partition: int, seq: int, reply: str, b: np.ndarray | None = None) -> np.ndarray:
    """A gradient of f_i at x (reply="gradient") or the model after local steps (reply="model"); ``b``:
    another optimum than partition i's."""
    rng = np.random.default_rng((partition, seq))
    b = B + offsets(partition + 1)[partition] if b is None else b
    if reply == "gradient":
        return (x - b + NOISE * rng.standard_normal(DIM)).astype(np.float32)
    y = x.astype(np.float64)
    for _ in range(LOCAL_STEPS):
        y = y - LOCAL_LR * (y - b + NOISE * rng.standard_normal(DIM))
    return y.astype(np.float32)


def hostile_update(x: np.ndarray, honest: np.ndarray, mode: str, reply: str, partition: int = HOSTILE_NODE,
                   seq: int = 0) -> np.ndarray:
    if mode in VALUES:
        return np.full(DIM, VALUES[mode], np.float32)
    sly = {"late10": ("flip10", seq >= 30), "alt10": ("flip10", seq % 2 == 1), "third250": ("x250", seq % 3 == 0)}
    if mode in sly:
        lie, now = sly[mode]
        return hostile_update(x, honest, lie, reply, partition, seq) if now else honest
    x = x.astype(np.float64)
    d = honest.astype(np.float64) if reply == "gradient" else x - honest  # the honest direction
    if mode == "x1000" or mode == "x250":
        lie = float(mode[1:]) * d
    elif mode.startswith("flip"):  # (flip1.4 too)
        lie = -float(mode[4:]) * d
    elif mode == "const":
        lie = U
    elif mode == "target":
        t = honest_update(x.astype(np.float32), partition, seq, reply, TARGET).astype(np.float64)
        lie = t if reply == "gradient" else x - t
    elif mode == "drift":
        lie = d + (seq / 500.0) * U
    else:
        raise ValueError(f"unknown hostile mode {mode!r}")
    return (lie if reply == "gradient" else x - lie).astype(np.float32)


def train(msg: Message, context: Context) -> Message:
    cfg = msg.content["config"]
    x = msg.content["arrays"]["w"].numpy()
    partition = int(context.node_config.get("client", context.node_config["partition-id"]))
    reply, seq = str(cfg["reply"]), int(cfg["job-seq"])
    out = honest_update(x, partition, seq, reply)
    mode = context.node_config.get("hostile", "")
    if mode:
        out = hostile_update(x, out, str(mode), reply, partition, seq)
    return Message(RecordDict({"arrays": ArrayRecord({"w": Array(out)}),
                               "metrics": MetricRecord({"loss": 0.0, "num-examples": 10})}), reply_to=msg)


app = ClientApp()
app.train()(train)
add_partition_query(app)  # (worker i is partition i: the hostile node is worker HOSTILE_NODE)


class HostileGrid(InProcessGrid):
    """``n`` nodes (four by default); the nodes ``hostile`` hostile in ``mode`` (every reply), or, with
    ``at=j``, only the j-th training reply of the run (in the order replies are computed: the
    virtual clock's) is 1e38. ``absent``: those clients are left out (the others keep their data
    and τ). ``taus``: the compute times of the nodes there are."""

    def __init__(self, mode: str = "", at: int = 0, *, hostile: tuple[int, ...] = (HOSTILE_NODE,), n: int = N,
                 absent: tuple[int, ...] = ()) -> None:
        clients = [i for i in range(n) if i not in absent]
        configs = [{"hostile": mode if (i in hostile and not at) else "", "client": i} for i in clients]
        super().__init__(app, len(clients), node_configs=configs)
        self.at, self.count = at, 0
        self.taus = [taus(n)[i] for i in clients]

    def _execute(self, msg: Message) -> Message:
        reply = super()._execute(msg)
        if msg.metadata.message_type != "train":
            return reply
        self.count += 1
        if self.count != self.at:
            return reply
        bad = hostile_update(msg.content["arrays"]["w"].numpy(), np.zeros(DIM), "1e38", "gradient")
        out = Message(RecordDict({"arrays": ArrayRecord({"w": Array(bad)}),
                                  "metrics": MetricRecord({"loss": 0.0, "num-examples": 10})}), reply_to=msg)
        out.metadata.__dict__["_message_id"] = reply.metadata.message_id
        return out


def cases() -> list[tuple[str, str]]:
    """(strategy, reply): every registered strategy with its default reply, and Rescaled ASGD with
    model replies."""
    out = [(name, cls.default_reply) for name, cls in STRATEGIES.items()]
    out.insert(1, ("rescaled", "model"))
    return out


def run(strategy: str, reply: str, grid: InProcessGrid, **options) -> tuple[np.ndarray | None, dict]:
    """The final model and the books of one run (None and the books when it failed)."""
    s = STRATEGIES[strategy](reply=reply, **options)
    x0 = ArrayRecord({"w": Array(np.zeros(DIM, np.float32))})
    t = getattr(grid, "taus", TAUS)
    try:
        result = s.start(grid, x0, num_updates=UPDATES, time_budget=20 * UPDATES * max(t),
                         clock=VirtualClock(DelayModel(t)), train_config={"reply": reply}, num_evaluations=1,
                         partition_query=True)
    except RunFailed as exc:
        return None, {**exc.books, "failed": str(exc)}
    return result.arrays["w"].numpy().astype(np.float64), dict(result.books)


def distance(x: np.ndarray | None, ref: np.ndarray) -> float:
    return float("nan") if x is None else float(np.linalg.norm(x - ref))


def table(modes: list[str]) -> None:
    """Print the scenario table: per strategy and hostile value, distance to the honest run's final
    model, updates, rejections by reason and whether the books balance."""
    print(f"{'strategy':16} {'reply':8} {'honest':>8} " + " ".join(f"{m:>26}" for m in modes))
    for strategy, reply in cases():
        ref, _ = run(strategy, reply, HostileGrid())
        cells = []
        for mode in modes:
            x, books = run(strategy, reply, HostileGrid(mode))
            rej = {k.split(".", 1)[1]: v for k, v in books.items() if k.startswith("rejected.")}
            what = "FAILED" if x is None else f"{distance(x, ref):.3g}"
            cells.append(f"{what} u={books.get('updates', 0)} " + ",".join(f"{k}={v}" for k, v in rej.items()))
        print(f"{strategy:16} {reply:8} {np.linalg.norm(ref):8.3f} " + " ".join(f"{c:>26}" for c in cells))


if __name__ == "__main__":
    import logging

    logging.getLogger("flwr").setLevel(logging.ERROR)
    table(sys.argv[1:] or MODES)

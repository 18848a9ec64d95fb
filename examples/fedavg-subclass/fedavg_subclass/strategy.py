"""``CustomAsync``: the customised FedAvg strategy of a Flower app, on an asynchronous base class.

It keeps the three features such a ``CustomFedAvg(FedAvg)`` has, each in the hook that replaces
FedAvg's:

- a learning-rate schedule: ``configure_job`` (FedAvg's ``configure_train``) halves the clients'
  ``lr`` every ``lr_half_life`` server updates;
- the best model and a results file: ``on_evaluation`` (FedAvg users do this in ``evaluate_fn``)
  appends every evaluation point to ``results.json`` and saves the model with the lowest central
  loss so far to ``best_model.npz``;
- a ``start()`` override that calls ``super().start(...)``: it prepares the output folder before
  the run, and writes the final model and ``summary.json`` after it.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid

from fl_rescaled import AsyncResult, RescaledASGD

log = logging.getLogger("flwr")


def save_npz(path: Path, arrays: ArrayRecord) -> None:
    """The model's arrays, by name, in a numpy ``.npz`` file (``np.load`` reads it back)."""
    np.savez(path, **{name: array.numpy() for name, array in arrays.items()})


class CustomAsync(RescaledASGD):
    """Rescaled ASGD with a learning-rate schedule, the best model saved and a results file.

    Parameters
    ----------
    lr_half_life : float (default: 20)
        The clients' learning rate ``config["lr"]`` halves every this many server updates:
        ``lr · 0.5 ** (updates / lr_half_life)``.
    out_dir : str or Path (default: "outputs")
        Where ``results.json``, ``best_model.npz``, ``final_model.npz`` and ``summary.json`` go.
    **kwargs
        Rescaled ASGD's options (``fraction_evaluate``, ``fraction_train``, ...); ``reply``
        defaults to ``"model"`` here, since the ClientApp returns its trained model.
    """

    default_reply = "model"

    def __init__(self, *, lr_half_life: float = 20.0, out_dir: str | Path = "outputs", **kwargs: Any) -> None:
        if not (math.isfinite(lr_half_life) and lr_half_life > 0):
            raise ValueError(f"lr_half_life must be a positive number, got {lr_half_life!r}")
        super().__init__(**kwargs)
        self.lr_half_life = float(lr_half_life)
        self.out_dir = Path(out_dir)
        self.best_loss = math.inf
        self.best_step: int | None = None

    # --- FedAvg's configure_train: a config for every job ------------------------------------------
    def configure_job(self, config: ConfigRecord, *, updates: int, time: float) -> ConfigRecord:
        config = super().configure_job(config, updates=updates, time=time)
        config["lr"] = float(config["lr"]) * 0.5 ** (updates / self.lr_half_life)
        return config

    # --- FedAvg's evaluate_fn side effects: one call per evaluation point ---------------------------
    def on_evaluation(self, step: int, arrays: ArrayRecord, metrics: dict[str, MetricRecord]) -> None:
        progress, server = metrics["progress"], metrics.get("server", MetricRecord())
        entry = {"step": step, "updates": int(progress["updates"]), "time": float(progress["time"]),
                 **{name: dict(record) for name, record in metrics.items() if name != "progress"}}
        results = self.out_dir / "results.json"
        history = json.loads(results.read_text()) if results.exists() else []
        results.write_text(json.dumps([*history, entry], indent=1))
        loss = float(server.get("loss", math.inf))
        if loss < self.best_loss:
            self.best_loss, self.best_step = loss, step
            save_npz(self.out_dir / "best_model.npz", arrays)
            log.info("[fedavg-subclass] new best model at evaluation %d (%d updates): loss %.4f",
                     step, entry["updates"], loss)

    # --- start(): before and after the run -----------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_updates: int | None = None,
              **kwargs: Any) -> AsyncResult:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "results.json").unlink(missing_ok=True)  # a fresh file for every run
        self.best_loss, self.best_step = math.inf, None
        log.info("[fedavg-subclass] writing results to %s", self.out_dir)
        result = super().start(grid, initial_arrays, num_updates, **kwargs)
        save_npz(self.out_dir / "final_model.npz", result.arrays)
        summary = {"updates": int(result.books["updates"]), "evaluations": len(result.progress),
                   "best_step": self.best_step,
                   "best_loss": None if self.best_step is None else self.best_loss}
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        log.info("[fedavg-subclass] %s", summary)
        return result

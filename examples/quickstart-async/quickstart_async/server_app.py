"""The ServerApp: Flower's quickstart ServerApp, with the strategy chosen by the run config.

``strategy = "fedavg"`` runs Flower's own FedAvg for ``num-server-rounds`` rounds; ``"fedbuff"``,
``"fedasync"`` and ``"rescaled"`` run an asynchronous strategy of fl_rescaled for ``num-trainings``
client trainings, the unit of FedAvg's work (``num-server-rounds`` × the nodes it trains per round:
10 rounds of 12 nodes are 120 trainings, whatever the strategy makes of them). The two branches of ``main`` differ only in the constructor, the budget argument
and where the run config's ``seed`` goes (FedAvg samples its nodes with Python's ``random``; an
asynchronous strategy draws them from ``start(seed=...)``): the ClientApp, the model, the configs
and the ``Result`` are the same.
"""

import math
import random

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Result

from fl_rescaled import AsyncDPFixedClipping, FedAsync, FedBuff, RescaledASGD
from quickstart_async.task import Net, central_test

app = ServerApp()


def make_async_strategy(name: str, buffer_size: int = 0, **fedavg_keywords):
    """One of fl_rescaled's asynchronous strategies, each with its defaults and FedAvg's keywords
    (FedBuff with ``buffer_size`` replies per update; 0: FedBuff's default, half the jobs in flight).

    All three take the trained models a FedAvg ClientApp returns: FedBuff and FedAsync do so by
    default, Rescaled ASGD with ``reply="model"`` (its own default is a gradient reply).
    """
    if name == "fedbuff":
        return FedBuff(buffer_size=buffer_size or None, **fedavg_keywords)
    if name == "fedasync":
        return FedAsync(**fedavg_keywords)
    if name == "rescaled":
        return RescaledASGD(reply="model", **fedavg_keywords)
    raise ValueError(f"unknown strategy {name!r}: choose fedavg, fedbuff, fedasync or rescaled")


def central_evaluation(examples: int):
    """Flower's ``evaluate_fn``: the global model on the server's held-out test images."""
    if examples <= 0:
        return None

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = Net()
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = central_test(net, examples)
        return MetricRecord({"loss": loss, "accuracy": accuracy})

    return evaluate


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train ``Net`` on the SuperNodes with the run config's strategy and report the outcome."""
    name = str(context.run_config["strategy"])
    keywords = {"fraction_train": float(context.run_config["fraction-train"]),
                "fraction_evaluate": float(context.run_config["fraction-evaluate"])}
    lr = float(context.run_config["learning-rate"])
    evaluate_fn = central_evaluation(int(context.run_config["central-examples"]))

    seed = int(context.run_config["seed"])
    torch.manual_seed(seed)
    arrays = ArrayRecord(Net().state_dict())

    if name == "fedavg":
        random.seed(seed)  # FedAvg's node sampling
        strategy = FedAvg(**keywords)
        result = strategy.start(
            grid=grid,
            initial_arrays=arrays,
            train_config=ConfigRecord({"lr": lr}),
            num_rounds=int(context.run_config["num-server-rounds"]),
            evaluate_fn=evaluate_fn,
        )
    else:
        strategy = make_async_strategy(name, int(context.run_config["buffer-size"]), **keywords)
        clipping_norm = float(context.run_config.get("dp-clipping-norm", 0.0))
        if clipping_norm > 0:  # server-side DP: the one-line switch (docs/privacy.md)
            strategy = AsyncDPFixedClipping(strategy, noise_multiplier=float(context.run_config["dp-noise-multiplier"]),
                                            clipping_norm=clipping_norm, seed=seed)
        result = strategy.start(
            grid=grid,
            initial_arrays=arrays,
            train_config=ConfigRecord({"lr": lr}),
            num_trainings=int(context.run_config["num-trainings"]),  # FedAvg's num_rounds × nodes per round
            evaluate_fn=evaluate_fn,
            seed=seed,  # the selection of nodes with fraction-train < 1
        )

    report(name, arrays, result)
    model_path = str(context.run_config.get("model-path", ""))
    if model_path:
        print(f"Saving the final model to {model_path}")
        torch.save(result.arrays.to_torch_state_dict(), model_path)


def report(name: str, initial: ArrayRecord, result: Result) -> None:
    """Print what the run did: the last federated evaluation and training metrics, the books of an
    asynchronous run, and how far the model moved."""

    def last(metrics: dict) -> str:
        if not metrics:
            return "-"
        key = max(metrics)
        return f"#{key} " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in metrics[key].items())

    before, after = initial.to_torch_state_dict(), result.arrays.to_torch_state_dict()
    moved = math.sqrt(sum(float(((after[k].double() - before[k].double()) ** 2).sum()) for k in before))
    print(f"[quickstart-async] strategy {name}: model moved by {moved:.4g} (L2)")
    print(f"[quickstart-async] federated evaluation {last(result.evaluate_metrics_clientapp)}")
    if getattr(result, "privacy", None):
        print(f"[quickstart-async] differential privacy: ε max {result.privacy['max_epsilon']:.4g}, mean "
              f"{result.privacy['mean_epsilon']:.4g} (δ = {result.privacy['delta']:.3g})")
    print(f"[quickstart-async] training metrics {last(result.train_metrics_clientapp)}")
    books = getattr(result, "books", None)  # asynchronous strategies only
    if books:
        print("[quickstart-async] books " + ", ".join(f"{k}={v}" for k, v in books.items()))

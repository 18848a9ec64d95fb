"""The ServerApp: builds ``CustomAsync`` from the run config and starts it, as a FedAvg app builds
and starts its ``CustomFedAvg`` (with ``num_updates`` in place of ``num_rounds``)."""

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedavg_subclass.strategy import CustomAsync
from fedavg_subclass.task import evaluate, from_arrays, initial_arrays, test_set

app = ServerApp()


def central_evaluation(examples: int):
    """Flower's ``evaluate_fn``: the global model on the server's held-out examples."""

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        loss, accuracy = evaluate(*from_arrays(arrays), test_set(examples))
        return MetricRecord({"loss": loss, "accuracy": accuracy})

    return evaluate_fn


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train the model on the SuperNodes with ``CustomAsync``."""
    cfg = context.run_config
    strategy = CustomAsync(lr_half_life=float(cfg["lr-half-life"]), out_dir=str(cfg["out-dir"]),
                           fraction_train=float(cfg["fraction-train"]),
                           fraction_evaluate=float(cfg["fraction-evaluate"]))
    strategy.start(
        grid=grid,
        initial_arrays=initial_arrays(int(cfg["seed"])),
        train_config=ConfigRecord({"lr": float(cfg["learning-rate"])}),
        num_updates=int(cfg["num-updates"]),
        evaluate_fn=central_evaluation(int(cfg["central-examples"])),
    )

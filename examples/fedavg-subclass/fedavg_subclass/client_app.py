"""The ClientApp: an ordinary FedAvg ClientApp. It trains the model it receives with the learning
rate its job's config carries (``lr``, which the strategy's schedule sets) and reports that rate
back as a metric; it evaluates the model it receives on its validation examples."""

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedavg_subclass.task import evaluate as evaluate_model
from fedavg_subclass.task import from_arrays, load_data, to_arrays
from fedavg_subclass.task import train as train_model

app = ClientApp()


def _data(context: Context):
    return load_data(int(context.node_config["partition-id"]), int(context.run_config["examples-per-client"]))


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received model on this node's data; reply with the trained model."""
    config = msg.content["config"]
    weight, bias = from_arrays(msg.content["arrays"])
    (x, y), _ = _data(context)
    lr = float(config["lr"])
    # A different shuffle for every job of this node (FedAvg sends ``server-round`` too).
    seed = 1000 * int(config.get("server-round", 0)) + int(context.node_config["partition-id"])
    weight, bias, loss = train_model(weight, bias, (x, y), lr=lr, epochs=int(context.run_config["local-epochs"]),
                                     batch_size=int(context.run_config["batch-size"]), seed=seed)
    metrics = MetricRecord({"train_loss": loss, "lr": lr, "num-examples": len(y)})
    return Message(content=RecordDict({"arrays": to_arrays(weight, bias), "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on this node's validation examples."""
    weight, bias = from_arrays(msg.content["arrays"])
    _, val = _data(context)
    loss, accuracy = evaluate_model(weight, bias, val)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(val[1])})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

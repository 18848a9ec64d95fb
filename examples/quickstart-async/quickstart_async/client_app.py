"""The ClientApp: an ordinary FedAvg ClientApp. It knows nothing of asynchrony or of fl_rescaled:
it trains the model it receives and returns it, and it evaluates the model it receives."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from quickstart_async.task import Net, load_data
from quickstart_async.task import test as evaluate_model
from quickstart_async.task import train as train_model

app = ClientApp()

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _loaders(context: Context):
    return load_data(
        partition_id=int(context.node_config["partition-id"]),
        num_partitions=int(context.node_config["num-partitions"]),
        batch_size=int(context.run_config["batch-size"]),
        examples_per_client=int(context.run_config["examples-per-client"]),
    )


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received model on this node's data; reply with the trained model."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainloader, _ = _loaders(context)
    train_loss = train_model(
        model,
        trainloader,
        epochs=int(context.run_config["local-epochs"]),
        lr=float(msg.content["config"]["lr"]),
        device=DEVICE,
    )
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"train_loss": train_loss, "num-examples": len(trainloader.dataset)}),
        }
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on this node's validation examples."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, valloader = _loaders(context)
    eval_loss, eval_acc = evaluate_model(model, valloader, DEVICE)
    content = RecordDict(
        {
            "metrics": MetricRecord(
                {"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(valloader.dataset)}
            )
        }
    )
    return Message(content=content, reply_to=msg)

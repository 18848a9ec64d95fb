"""The same ClientApp built with fl_rescaled's torch helper: batched across the jobs in flight.

``torch_client_app`` turns the model (``Net``), a loss and each node's training tensors into a
``BatchedClientApp``. On Flower's engine or in a deployment it trains one message at a time with
``nn.Module`` and autograd; on fl_rescaled's in-process Grid the jobs in flight are trained together,
one ``torch.func.vmap`` per local SGD step. Its local training is plain SGD for ``local-epochs``
passes' worth of minibatches drawn per job (the original ``client_app`` uses momentum and a
DataLoader), so the two apps give different, equally valid, models. ``evaluate`` is the original's.

Use it with ``clientapp = "quickstart_async.batched_app:app"`` in ``pyproject.toml``, or pass it to
``fl_rescaled.run_inprocess``. The environment variable ``QUICKSTART_DEVICE`` (``cpu``, ``cuda``, ``auto``;
a job config's ``device`` key overrides it) picks the device.
"""

import math
import os

import torch.nn.functional as F
from flwr.app import Context

from fl_rescaled.torch_batch import torch_client_app
from quickstart_async.client_app import evaluate
from quickstart_async.task import Net, _partition

#: Rows per minibatch and learning rate when the run config has none (the app's defaults).
BATCH_SIZE, LR = 32, 0.05
EXAMPLES_PER_CLIENT, LOCAL_EPOCHS = 500, 1


def client_data(context: Context):
    """This node's training images and labels, as the original app's loader sees them."""
    train_set, _ = _partition(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]),
                              int(context.run_config.get("examples-per-client", EXAMPLES_PER_CLIENT)))
    return train_set.tensors


def local_steps(examples: int = EXAMPLES_PER_CLIENT, epochs: int = LOCAL_EPOCHS, batch: int = BATCH_SIZE) -> int:
    """The minibatches of ``epochs`` passes over a node's training share (80 % of its examples)."""
    return epochs * math.ceil(round(0.8 * examples) / batch)


app = torch_client_app(Net, F.cross_entropy, client_data, batch_size=BATCH_SIZE, local_steps=local_steps(), lr=LR,
                       device=os.environ.get("QUICKSTART_DEVICE", "cpu"))
app.evaluate()(evaluate)

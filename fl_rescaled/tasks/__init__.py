"""Learning tasks: what a worker's stochastic gradient is, and how the global objective is scored.

- ``quadratic``: F_i(x) = a_i · ‖x − b_i‖² (every coordinate), optional Gaussian gradient noise σ.
  The minimiser of Σ w_i F_i is x* = Σ w_i a_i b_i / Σ w_i a_i, so fixed points can be checked
  exactly.
- ``mnist``: the paper's MLP 784 → 128 (ReLU) → 10 with cross-entropy, one minibatch per gradient,
  on worker i's label partition. The model is one flat float32 vector [W1, b1, W2, b2] (row-major,
  PyTorch's ``nn.Linear`` layout); its gradient is computed by hand with torch kernels, which is
  checked against autograd in the tests.

A task is fully described by a small config dict (the keys the server puts in every job's
``ConfigRecord``), so the ClientApp can rebuild it in any process; ``get_task`` caches tasks per
config so in-process clients share one copy of the data.
"""

from .base import ALIGN, TASK_KEYS, TASKS, Task, aligned_empty, client_rng, local_sgd, scratch
from .mnist import MnistTask, mlp_gradient
from .quadratic import QuadraticTask
from .registry import build_task, get_task, task_spec
from .replicas import ReplicaTask, job_rng

__all__ = [
    "ALIGN",
    "TASKS",
    "TASK_KEYS",
    "MnistTask",
    "QuadraticTask",
    "ReplicaTask",
    "Task",
    "aligned_empty",
    "build_task",
    "client_rng",
    "get_task",
    "job_rng",
    "local_sgd",
    "mlp_gradient",
    "scratch",
    "task_spec",
]

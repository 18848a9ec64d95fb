"""The worker process of ``fl_rescaled.tasks.kernel_process``: its loop, started as
``python -P -m fl_rescaled.tasks.kernel_worker`` with the shared file, its slots, the model's size,
the minibatch size and the task's spec.

It reads slot numbers from stdin, computes each job with ``batched.rows_job`` on data it loads itself
from the spec (one torch thread, the caller's kernel), writes the result over the slot's model and the number
to stdout (flagged when it skipped a stolen job or could not compute one). What goes wrong before it
says it is ready is written to stderr, which the caller quotes when it gives the worker up; after
that its stderr is discarded.
"""

from __future__ import annotations

import os
import struct
import sys

import numpy as np

from .batched import device_data, rows_job
from .kernel_process import _FAILED, _READY, _SKIPPED, _layout, _views
from .registry import get_task


def _serve(path: str, slots: int, size: int, batch: int, spec: str) -> None:
    """The worker's loop: read a slot number, compute its job, write the number back (-1 stops)."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # (anything the task prints goes to stderr, never into the answers)
    import torch

    torch.set_num_threads(1)
    task = get_task(spec)
    X, Y, _, _ = device_data(task, "cpu")
    mem = np.memmap(path, dtype=np.uint8, mode="r+")
    views = _views(mem, _layout(size, batch, slots), size)
    job, taken, stolen, losses = views.pop("job"), views.pop("taken"), views.pop("stolen"), views.pop("losses")
    # Each slot's model (1, P) and rows (steps, batch) as tensors over the shared file, made once.
    models = [torch.from_numpy(views["models"][s:s + 1]) for s in range(slots)]
    rows = [torch.from_numpy(views["rows"][s]).view(-1, batch) for s in range(slots)]
    out.write(struct.pack("<i", _READY))
    null = os.open(os.devnull, os.O_WRONLY)  # (started: the caller no longer reads what it says)
    os.dup2(null, 1)
    os.dup2(null, 2)
    inp = sys.stdin.buffer
    while True:
        data = inp.read(4)
        if len(data) != 4:
            return
        slot = struct.unpack("<i", data)[0]
        if slot < 0:
            return
        try:
            taken[slot] = 1
            if stolen[slot]:  # (the caller computes it: see ``KernelProcess.result``)
                out.write(struct.pack("<i", slot | _SKIPPED))
                continue
            steps, lr, prox = job[slot].tolist()
            model = models[slot]  # (the result goes over it: its memory is hot here)
            y, loss = rows_job(X, Y, model, rows[slot], batch, int(steps), lr, prox, out=model)
            if y.data_ptr() != model.data_ptr():  # (local steps: the trained model, a tensor of its own)
                model.copy_(y)
            losses[slot] = loss
            out.write(struct.pack("<i", slot))
        except Exception:  # noqa: BLE001 - the caller computes this job in process
            out.write(struct.pack("<i", slot | _FAILED))


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])

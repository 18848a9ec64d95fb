"""The job protocol between the asynchronous server and the ClientApp.

A *job* message (type ``train``) carries
  - ``arrays``:  ArrayRecord {"model": flat float32 vector}
  - ``config``:  ConfigRecord with the task description and the job tag
                 (``job-id``, ``worker``, ``version``, ``job-seq``, ``seed``, ...).
A *reply* carries
  - ``update``:  ArrayRecord {"update": flat float32 vector} (a gradient, or a model delta)
  - ``metrics``: MetricRecord (``loss``, ``batch-size``, ``job-id``, ``compute-time``, ...).

Flower's ``Array`` stores ``.npy`` bytes. Encoding a flat float32 vector by prefixing a cached
``.npy`` header to its raw bytes, and decoding it with ``np.frombuffer`` past the header, gives the
same bytes as ``Array(ndarray)`` / ``Array.numpy()`` at a fraction of their cost (the model is sent
on every update, so this is on the hot path).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import numpy.lib.format as npy_format
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

JOB_TYPE = "train"
HELLO_TYPE = "query.hello"
MODEL_KEY = "model"
UPDATE_KEY = "update"

_HEADERS: dict[tuple[str, tuple[int, ...]], bytes] = {}
# (dtype, length) -> (.npy header, dtype name, shape): everything a flat vector's Array needs.
_FLAT: dict[tuple[np.dtype, int], tuple[bytes, str, tuple[int]]] = {}
# (dtype name, length) -> (.npy header, dtype, expected data length), for decoding.
_FLAT_DECODE: dict[tuple[str, int], tuple[bytes, np.dtype, int]] = {}


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    key = (dtype.str, shape)
    hdr = _HEADERS.get(key)
    if hdr is None:
        buf = io.BytesIO()
        npy_format.write_array_header_1_0(
            buf, {"descr": npy_format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
        )
        hdr = _HEADERS[key] = buf.getvalue()
    return hdr


def _flat_layout(dtype: np.dtype, n: int) -> tuple[bytes, str, tuple[int]]:
    key = (dtype, n)
    ent = _FLAT.get(key)
    if ent is None:
        ent = _FLAT[key] = (_npy_header(dtype, (n,)), str(dtype), (n,))
    return ent


def encode_vector(vec: np.ndarray) -> Array:
    """Wrap a 1-D array as a Flower ``Array`` (valid ``.npy`` bytes; a snapshot copy)."""
    if type(vec) is not np.ndarray or not vec.flags.c_contiguous:
        vec = np.ascontiguousarray(vec)
    if vec.ndim != 1:
        raise ValueError("encode_vector takes a flat (1-D) array")
    hdr, dtype, shape = _flat_layout(vec.dtype, vec.shape[0])
    # One copy: the header and the raw buffer joined straight into the new bytes object.
    return Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=b"".join((hdr, vec)))


def decode_vector(arr: Array) -> np.ndarray:
    """Read a flat array out of an ``Array`` without copying (read-only view).

    Falls back to Flower's own ``.numpy()`` for anything but our fast layout.
    """
    shape = arr.shape
    if len(shape) == 1 and arr.stype == "numpy.ndarray":
        key = (arr.dtype, shape[0])
        ent = _FLAT_DECODE.get(key)
        if ent is None:
            try:
                dtype = np.dtype(arr.dtype)
                n = int(shape[0])
                hdr = _npy_header(dtype, (n,))
                if not dtype.hasobject:
                    ent = _FLAT_DECODE[key] = (hdr, dtype, len(hdr) + dtype.itemsize * n)
            except (TypeError, ValueError):
                ent = None
        if ent is not None:
            hdr, dtype, size = ent
            data = arr.data
            if len(data) == size and data.startswith(hdr):
                return np.frombuffer(data, dtype=dtype, offset=len(hdr))
    return arr.numpy().reshape(-1)


class RejectedReply(Exception):
    """A reply that must not touch the model; ``reason`` is a short machine-readable tag."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _array_record(key: str, arr: Array) -> ArrayRecord:
    rec = ArrayRecord()
    rec[key] = arr  # (cheaper than ArrayRecord({key: arr}), same record)
    return rec


def job_content(model: Array, config: dict[str, Any]) -> RecordDict:
    return RecordDict({"arrays": _array_record(MODEL_KEY, model), "config": ConfigRecord(config)})


def hello_content() -> RecordDict:
    return RecordDict({"config": ConfigRecord({"hello": 1})})


def hello_message(node_id: int, ttl: float) -> Message:
    """The ``query.hello`` that asks a node which partition (worker index) it holds."""
    return Message(hello_content(), node_id, HELLO_TYPE, ttl=ttl)


def parse_hello(reply: Message) -> int | None:
    """The partition id a node answered with, or None for an error or a malformed reply."""
    if not (reply.has_content() and "hello" in reply.content.metric_records):
        return None
    return int(reply.content.metric_records["hello"]["partition-id"])


def reply_content(update: np.ndarray, metrics: dict[str, Any]) -> RecordDict:
    return RecordDict(
        {"update": _array_record(UPDATE_KEY, encode_vector(update)), "metrics": MetricRecord(metrics)}
    )


def parse_reply(reply: Message, job_id: int, size: int, replicas: int = 1) -> tuple[np.ndarray, dict[str, Any]]:
    """Validate a job's reply and return (update vector, metrics) or raise ``RejectedReply``.

    ``replicas`` > 1 (batched runs: the vector is R replicas' updates end to end): a replica
    whose slice is non-finite is zeroed in a copy and named in ``metrics["nonfinite-replicas"]``
    instead of rejecting the reply for every replica (the strategy freezes that replica).
    """
    if reply.has_error():
        err = reply.error
        raise RejectedReply(f"error-code-{err.code}", str(err.reason)[:200])
    if not reply.has_content():
        raise RejectedReply("no-content")
    content = reply.content
    # Direct lookups (RecordDict's array_records/metric_records views are rebuilt on every access).
    try:
        arrays = content["update"]
        metrics_rec = content["metrics"]
        if not isinstance(arrays, ArrayRecord):
            raise KeyError("update")
        if not isinstance(metrics_rec, MetricRecord):
            raise KeyError("metrics")
        arr = arrays[UPDATE_KEY]
        metrics = dict(metrics_rec.items())
    except (KeyError, TypeError) as exc:
        raise RejectedReply("malformed", f"missing {exc}") from None
    if int(metrics.get("job-id", -1)) != job_id:
        raise RejectedReply("unknown-job", f"reply names job {metrics.get('job-id')}, expected {job_id}")
    try:
        vec = decode_vector(arr)
    except Exception as exc:  # noqa: BLE001 - any undecodable payload is rejected
        raise RejectedReply("malformed", f"undecodable array: {exc}") from None
    if vec.shape != (size,):
        raise RejectedReply("wrong-shape", f"got {vec.shape}, expected ({size},)")
    if vec.dtype.kind != "f":
        raise RejectedReply("wrong-dtype", str(vec.dtype))
    # A sum is finite only if every term is; the exact test runs only when it is not (overflow).
    if not np.isfinite(np.dot(vec, vec)) and not np.isfinite(vec).all():
        if replicas <= 1:
            raise RejectedReply("non-finite")
        rows = vec.reshape(replicas, -1).copy()
        bad = ~np.isfinite(rows).all(axis=1)
        rows[bad] = 0.0
        vec = rows.reshape(-1)
        metrics["nonfinite-replicas"] = [int(r) for r in np.flatnonzero(bad)]
    return vec, metrics

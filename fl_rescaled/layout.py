"""The user's model layout: an ``ArrayRecord`` of named arrays, and the flat vector the server steps.

A strategy receives the model as Flower's ``ArrayRecord`` (for example ``ArrayRecord(model.state_dict())``)
and must send every job, and read every reply, in exactly that layout: the same keys in the same order,
the same shapes, and each array in its own dtype. ``ModelLayout`` records that layout once and converts
between it and what the server computes with:

- the **float arrays** are concatenated, in record order, into one flat vector ``x`` (of the arrays'
  common float type: float32 for a float32 model), which every stepsize rule updates in place;
- the **other arrays** (integers, booleans: a BatchNorm layer's ``num_batches_tracked``, say) are
  *carried*: never promoted, never stepped, sent as they are.

Encoding and decoding are on the hot path (a model goes out with every job and comes back with every
reply), so both skip Flower's ``np.save``/``np.load``: an array is the cached ``.npy`` header of its
(dtype, shape) followed by its raw bytes, which is exactly what ``Array(ndarray)`` produces, and it is
read back with ``np.frombuffer`` past the header, without a copy. Anything else (a Fortran-ordered
array, another serialisation) falls back to Flower's own ``Array.numpy()``, and is refused unless its
bytes hold one array of exactly the dtype and shape the ``Array`` declares.

``flatten`` validates a reply against the layout and raises ``RejectedReply`` naming what was expected.
A float array of the model accepts only float arrays, of any width, cast to the model's dtype: a
float32 reply to a float64 model is cast up, a float64 reply to a float32 model down (a value beyond
float32's range then becomes infinite, and the finiteness check rejects the reply as ``non-finite``).
An integer, boolean or complex array where the model has floats is refused (``wrong-dtype``): it is
not a model nor a gradient, whatever numpy would cast it to. A carried array accepts only its own
dtype or one that widens to it without loss (int32 → int64), never a narrowing (floats to an
integer array, int64 to int32).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.lib.format as npy_format
from flwr.app import Array, ArrayRecord, Message

from .errors import RejectedReply
from .messages import JOB_TYPE, plain_array, plain_record, reply_metrics

_HEADERS: dict[tuple[str, tuple[int, ...]], bytes] = {}


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` (version 1.0, C order) header that ``np.save`` writes for this dtype and shape."""
    key = (dtype.str, shape)
    hdr = _HEADERS.get(key)
    if hdr is None:
        buf = io.BytesIO()
        npy_format.write_array_header_1_0(
            buf, {"descr": npy_format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
        )
        hdr = _HEADERS[key] = buf.getvalue()
    return hdr


# (dtype, shape) -> (.npy header, dtype name, shape): everything an Array of that layout needs.
_ENCODE: dict[tuple[np.dtype, tuple[int, ...]], tuple[bytes, str, tuple[int, ...]]] = {}
# (dtype name, shape) -> (.npy header, dtype, data length), for decoding.
_DECODE: dict[tuple[str, tuple], tuple[bytes, np.dtype, int] | None] = {}


def encode_array(a: np.ndarray) -> Array:
    """``Array(a)`` (the same bytes) without ``np.save``: header and raw data joined in one copy."""
    if type(a) is not np.ndarray or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    key = (a.dtype, a.shape)
    ent = _ENCODE.get(key)
    if ent is None:
        if a.dtype.hasobject:
            raise ValueError("object arrays cannot be sent")
        shape = tuple(int(s) for s in a.shape)
        ent = _ENCODE[key] = (npy_header(a.dtype, shape), str(a.dtype), shape)
    hdr, dtype, shape = ent
    return plain_array(dtype, shape, b"".join((hdr, a.reshape(-1))))


def decode_array(arr: Array) -> np.ndarray:
    """The ndarray an ``Array`` holds: a read-only view of its bytes when they are plain C-order
    ``.npy`` (as ``encode_array`` and ``Array(ndarray)`` write them), else Flower's ``numpy()``."""
    if arr.stype == "numpy.ndarray":
        shape = arr.shape
        key = (arr.dtype, shape if type(shape) is tuple else tuple(shape))
        try:
            ent = _DECODE[key]
        except KeyError:
            ent = _decode_entry(*key)
        except TypeError:  # an unhashable shape: not ours
            ent = None
        if ent is not None:
            hdr, dtype, size = ent
            data = arr.data
            if len(data) == size and data.startswith(hdr):
                return np.frombuffer(data, dtype=dtype, offset=len(hdr)).reshape(key[1])
    a = arr.numpy()
    if not isinstance(a, np.ndarray):  # np.load also reads .npz archives
        getattr(a, "close", lambda: None)()
        raise ValueError(f"its bytes are not one .npy array but a {type(a).__name__}")
    if str(a.dtype) != str(arr.dtype) or list(a.shape) != list(arr.shape):
        raise ValueError(f"it is declared {arr.dtype}{list(arr.shape)} but its bytes hold {a.dtype}{list(a.shape)}")
    return a


def _decode_entry(dtype_name: str, shape: tuple) -> tuple[bytes, np.dtype, int] | None:
    try:
        dtype = np.dtype(dtype_name)
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        return None
    if dtype.hasobject or any(d < 0 for d in dims):
        return None
    hdr = npy_header(dtype, dims)
    ent = _DECODE[(dtype_name, shape)] = (hdr, dtype, len(hdr) + dtype.itemsize * math.prod(dims))
    return ent


def all_finite(flat: np.ndarray) -> bool:
    """Whether every value of the 1-d ``flat`` is finite. A sum of squares is finite only if every
    term is, so the exact, slower test runs only when it is not (a NaN, an inf, or an overflow)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.dot(flat, flat)):
            return True
    return bool(np.isfinite(flat).all())


@dataclass(frozen=True)
class Entry:
    """One array of the layout: where its values sit in the flat vector (float arrays only)."""

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype
    is_float: bool
    offset: int  # into the flat vector (float arrays), else -1
    size: int


class ModelLayout:
    """Keys, shapes and dtypes of a model given as an ``ArrayRecord``; see the module docstring."""

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.by_key = {e.key: e for e in entries}
        floats = [e for e in entries if e.is_float]
        self.floats = floats
        self.flat_size = sum(e.size for e in floats)
        self.flat_dtype = np.result_type(*[e.dtype for e in floats]) if floats else np.dtype(np.float32)
        # One float array whose dtype is the flat vector's: the flat vector *is* that array (no copies).
        self.single = floats[0] if len(floats) == 1 and floats[0].dtype == self.flat_dtype else None

    @classmethod
    def of(cls, arrays: ArrayRecord) -> tuple[ModelLayout, np.ndarray, dict[str, np.ndarray]]:
        """The layout of ``arrays``, its flat float vector (a fresh copy) and its carried arrays."""
        if not isinstance(arrays, ArrayRecord):
            raise TypeError(f"initial_arrays must be an ArrayRecord, got {type(arrays).__name__}")
        if len(arrays) == 0:
            raise ValueError("initial_arrays is empty: there is no model to train")
        entries, values, offset = [], {}, 0
        for key, arr in arrays.items():
            a = np.asarray(arr.numpy())
            is_float = a.dtype.kind == "f"
            entries.append(Entry(key, tuple(a.shape), a.dtype, is_float, offset if is_float else -1, int(a.size)))
            if is_float:
                offset += int(a.size)
            values[key] = a
        layout = cls(entries)
        if not layout.floats:
            raise ValueError("initial_arrays has no floating-point array: nothing could be trained")
        flat = np.empty(layout.flat_size, dtype=layout.flat_dtype)
        for e in layout.floats:
            flat[e.offset:e.offset + e.size] = values[e.key].reshape(-1)
        carried = {e.key: np.array(values[e.key]) for e in entries if not e.is_float}
        return layout, flat, carried

    def record_of(self, arrays: dict[str, np.ndarray], what: str) -> ArrayRecord:
        """``arrays`` (a model read from a file) as the record jobs carry; ValueError naming ``what``
        when they do not fit this layout."""
        rec = ArrayRecord({k: encode_array(np.asarray(a)) for k, a in arrays.items()})
        try:
            self.flatten(rec, check_finite=False)
        except RejectedReply as exc:
            raise ValueError(f"{what} does not fit the model: {exc}") from None
        return rec

    def describe(self) -> str:
        parts = [f"{e.key!r}: {e.dtype}{list(e.shape)}" for e in self.entries]
        return "{" + ", ".join(parts) + "}"

    # ------------------------------------------------------------------ server -> client
    def encode(self, flat: np.ndarray, carried: dict[str, np.ndarray]) -> ArrayRecord:
        """The model in the user's layout (a snapshot: later steps of ``flat`` do not change it)."""
        arrays = {}
        for e in self.entries:
            if e.is_float:
                part = flat[e.offset:e.offset + e.size]
                if part.dtype != e.dtype:
                    part = part.astype(e.dtype)
                arrays[e.key] = encode_array(part.reshape(e.shape))
            else:
                arrays[e.key] = encode_array(carried[e.key])
        return plain_record(ArrayRecord, arrays)

    def to_record(self, flat: np.ndarray, carried: dict[str, np.ndarray]) -> ArrayRecord:
        """``encode`` for the user (evaluation, the result): the same arrays, built by Flower."""
        rec = ArrayRecord()
        for e in self.entries:
            if e.is_float:
                a = np.array(flat[e.offset:e.offset + e.size], dtype=e.dtype).reshape(e.shape)
            else:
                a = np.array(carried[e.key])
            rec[e.key] = Array(a)
        return rec

    # ------------------------------------------------------------------ client -> server
    def flatten(self, rec: ArrayRecord, *, carried_required: bool = True,
                check_finite: bool = True) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Validate ``rec`` against the layout; return its flat float vector and its carried arrays.

        The flat vector is a read-only view of the message when the model is one float array,
        else a fresh array. Raises ``RejectedReply`` (reason ``malformed``, ``wrong-shape``,
        ``wrong-dtype`` or ``non-finite``) with a message that names what was expected.
        ``carried_required=False``: the non-float arrays may be left out (a gradient has none).
        """
        single = self.single
        if single is not None and len(rec) == 1 and len(self.entries) == 1:  # the hot path: one array
            try:
                a = decode_array(rec[single.key])
            except KeyError:
                pass
            except Exception as exc:  # noqa: BLE001 - any undecodable payload is rejected
                raise RejectedReply("malformed", f"array {single.key!r} cannot be decoded: {exc}") from None
            else:
                if a.shape != single.shape:
                    raise RejectedReply("wrong-shape", f"array {single.key!r} has shape {list(a.shape)}, "
                                                       f"expected {list(single.shape)}")
                if a.dtype != single.dtype:
                    a = _cast(a, single)
                flat = a.reshape(-1)
                if check_finite and not all_finite(flat):
                    raise RejectedReply("non-finite", f"NaN or infinite values in {single.key!r}")
                return flat, {}
        keys = list(rec.keys())
        expected = [e.key for e in self.entries]
        if keys != expected:
            missing = [k for k in expected if k not in rec]
            extra = [k for k in keys if k not in self.by_key]
            if not carried_required:
                missing = [k for k in missing if self.by_key[k].is_float]
            if missing or extra:
                what = []
                if missing:
                    what.append(f"missing {_keys(missing)}")
                if extra:
                    what.append(f"unexpected {_keys(extra)}")
                raise RejectedReply("malformed", f"arrays {'; '.join(what)} (the model's arrays are {self.describe()})")
        values: dict[str, np.ndarray] = {}
        for e in self.entries:
            if e.key not in rec:
                continue
            try:
                a = decode_array(rec[e.key])
            except Exception as exc:  # noqa: BLE001 - any undecodable payload is rejected
                raise RejectedReply("malformed", f"array {e.key!r} cannot be decoded: {exc}") from None
            if a.shape != e.shape:
                raise RejectedReply("wrong-shape", f"array {e.key!r} has shape {list(a.shape)}, expected {list(e.shape)}")
            if a.dtype != e.dtype:
                a = _cast(a, e)
            values[e.key] = a
        if self.single is not None:
            flat = values[self.single.key].reshape(-1)
        else:
            flat = np.empty(self.flat_size, dtype=self.flat_dtype)
            for e in self.floats:
                flat[e.offset:e.offset + e.size] = values[e.key].reshape(-1)
        if check_finite and not all_finite(flat):
            bad = [e.key for e in self.floats if not np.isfinite(values[e.key]).all()]
            raise RejectedReply("non-finite", f"NaN or infinite values in {_keys(bad)}")
        carried = {e.key: values[e.key] for e in self.entries if not e.is_float and e.key in values}
        return flat, carried


def _cast(a: np.ndarray, e: Entry) -> np.ndarray:
    """A reply's array in the model's dtype (the rules of the module docstring): a float entry takes
    any float array (cast up or down; a value beyond the model's range becomes infinite and the
    finiteness check rejects it), a carried entry only a lossless widening (numpy's "safe" casts)."""
    if e.is_float:
        if a.dtype.kind == "f":
            with np.errstate(over="ignore"):  # (beyond the range: ±inf, rejected as non-finite)
                return a.astype(e.dtype)
        raise RejectedReply("wrong-dtype", f"array {e.key!r} is {a.dtype}, expected {e.dtype} (or floats of any "
                                           "width, cast to it); integer, boolean and complex arrays are refused")
    if np.can_cast(a.dtype, e.dtype, "safe"):
        return a.astype(e.dtype)
    raise RejectedReply("wrong-dtype", f"array {e.key!r} is {a.dtype}, expected {e.dtype} (a non-float array is "
                                       "cast to the model's dtype only when that loses nothing)")


def _keys(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def array_record_of(content: Any, key: str) -> ArrayRecord:
    """The reply's ArrayRecord: the one named ``key``, or the only one there is (as Flower's FedAvg
    accepts); raises ``RejectedReply`` otherwise."""
    try:
        rec = content[key]
        if isinstance(rec, ArrayRecord):
            return rec
    except KeyError:
        pass
    found = [k for k, v in content.items() if isinstance(v, ArrayRecord)]
    if len(found) == 1:
        return content[found[0]]
    if not found:
        raise RejectedReply("malformed", f"the reply has no ArrayRecord (expected one named {key!r})")
    raise RejectedReply("malformed", f"the reply has {len(found)} ArrayRecords {found}, none named {key!r}")


def read_reply(reply: Message, layout: ModelLayout, *, arrayrecord_key: str = "arrays",
                carried_required: bool = True, check_finite: bool = True):
    """Validate a job's reply (Flower's error replies, its type, its arrays against ``layout``).

    Returns (flat float vector, carried non-float arrays, numeric metrics) or raises
    ``RejectedReply`` with a reason tag and a message that names what was expected.
    """
    if reply.has_error():  # (before the type: Flower answers an expired job with a "system" error)
        err = reply.error
        raise RejectedReply(f"error-code-{err.code}", str(err.reason))
    if reply.metadata.message_type != JOB_TYPE:
        raise RejectedReply("wrong-type", f"a {reply.metadata.message_type!r} message answers a {JOB_TYPE!r} job")
    if not reply.has_content():
        raise RejectedReply("no-content", "the reply carries neither content nor an error")
    content = reply.content
    flat, carried = layout.flatten(array_record_of(content, arrayrecord_key), carried_required=carried_required,
                                   check_finite=check_finite)
    return flat, carried, reply_metrics(content)

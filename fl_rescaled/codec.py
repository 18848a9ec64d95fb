"""State as data: dataclasses to JSON plus named arrays, and back, checked against their type hints.

A run's state (``fl_rescaled.runstate``) is made of dataclasses whose fields are numbers, strings,
lists, dicts, numpy arrays, numpy random generators and other such dataclasses. ``encode`` turns
one into a JSON-able tree in which every array is replaced by ``{"$array": name}`` (the array goes
into a separate dict, written to an ``.npz`` by ``fl_rescaled.checkpoints``) and every generator by
``{"$rng": its bit generator's state}``. ``decode(cls, tree, arrays)`` rebuilds it, and checks every
value against the field's type hint on the way: a file that does not match the schema is refused
with one line naming the field (``StateError``), never half-loaded. Nothing a file says is imported
or called: the only classes built are the ones the schema names, and generators are PCG64 only.

A field whose metadata has ``transient=True`` is not written (a cache, a callback); ``decode`` leaves
it at its default. A dataclass may define ``check(self)`` (raise ``ValueError``) for what types
cannot say (array lengths, ranges); ``decode`` calls it.
"""

from __future__ import annotations

import base64
import dataclasses
import types
import typing
from typing import Any

import numpy as np

#: Array dtypes a state may hold (no object arrays, nothing a file could make executable).
DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                    "float16", "float32", "float64", "complex64", "complex128"})


class StateError(ValueError):
    """A state that does not match its schema; the message names the field."""


def encode(obj: Any, arrays: dict[str, np.ndarray], path: str = "state") -> Any:
    """``obj`` as a JSON-able tree; its arrays go into ``arrays`` under names derived from ``path``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: encode(getattr(obj, f.name), arrays, f"{path}.{f.name}")
                for f in dataclasses.fields(obj) if not f.metadata.get("transient")}
    if isinstance(obj, np.ndarray):
        if obj.dtype.name not in DTYPES:
            raise StateError(f"{path}: arrays of {obj.dtype} cannot be stored")
        name = path if path not in arrays else f"{path}#{len(arrays)}"
        arrays[name] = obj
        return {"$array": name}
    if isinstance(obj, np.random.Generator):
        return {"$rng": obj.bit_generator.state}
    if isinstance(obj, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {str(k): encode(v, arrays, f"{path}.{k}") for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted(encode(v, arrays, path) for v in obj)
    if isinstance(obj, (list, tuple)):
        return [encode(v, arrays, f"{path}.{i}") for i, v in enumerate(obj)]
    raise StateError(f"{path}: a {type(obj).__name__} cannot be stored")


def decode(tp: Any, data: Any, arrays: dict[str, np.ndarray], path: str = "state") -> Any:
    """The value of type ``tp`` that ``data`` (from ``encode``) describes; ``StateError`` if it does not match."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return _plain(data, path)
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return decode(option, data, arrays, path)
            except StateError as exc:
                errors.append(str(exc))
        raise StateError(errors[0] if len(errors) == 1 else f"{path}: matches none of {tp}")
    if dataclasses.is_dataclass(tp):
        return _dataclass(tp, data, arrays, path)
    if tp is np.ndarray:
        return _array(data, arrays, path)
    if tp is np.random.Generator:
        return _generator(data, path)
    if tp is bytes:
        if not (isinstance(data, dict) and set(data) == {"$bytes"} and isinstance(data["$bytes"], str)):
            raise StateError(f"{path}: expected bytes")
        try:
            return base64.b64decode(data["$bytes"], validate=True)
        except ValueError:
            raise StateError(f"{path}: bad base64") from None
    if tp is bool:
        if not isinstance(data, bool):
            raise StateError(f"{path}: expected true or false, got {_show(data)}")
        return data
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise StateError(f"{path}: expected an integer, got {_show(data)}")
        return data
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise StateError(f"{path}: expected a number, got {_show(data)}")
        return float(data)
    if tp is str:
        if not isinstance(data, str):
            raise StateError(f"{path}: expected a string, got {_show(data)}")
        return data
    if origin in (list, tuple, set, frozenset):
        if not isinstance(data, list):
            raise StateError(f"{path}: expected a list, got {_show(data)}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(data):
                raise StateError(f"{path}: expected {len(args)} items, got {len(data)}")
            return tuple(decode(a, v, arrays, f"{path}.{i}") for i, (a, v) in enumerate(zip(args, data)))
        item = args[0] if args else Any
        values = [decode(item, v, arrays, f"{path}.{i}") for i, v in enumerate(data)]
        return origin(values) if origin is not list else values
    if origin is dict:
        key_tp, value_tp = args if args else (str, Any)
        if not isinstance(data, dict):
            raise StateError(f"{path}: expected a mapping, got {_show(data)}")
        out = {}
        for k, v in data.items():
            key: Any = k
            if key_tp is int:
                try:
                    key = int(k)
                except ValueError:
                    raise StateError(f"{path}: expected integer keys, got {k!r}") from None
            out[key] = decode(value_tp, v, arrays, f"{path}.{k}")
        return out
    raise StateError(f"{path}: the schema has a type ({tp}) this codec does not read")


def _dataclass(cls: type, data: Any, arrays: dict[str, np.ndarray], path: str) -> Any:
    if not isinstance(data, dict):
        raise StateError(f"{path}: expected a {cls.__name__} record, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if not f.metadata.get("transient")]
    names = {f.name for f in fields}
    unknown = sorted(set(data) - names)
    if unknown:
        raise StateError(f"{path}: unexpected field {unknown[0]!r} in a {cls.__name__}")
    values = {}
    for f in fields:
        if f.name not in data:
            raise StateError(f"{path}: missing field {f.name!r} of a {cls.__name__}")
        values[f.name] = decode(hints[f.name], data[f.name], arrays, f"{path}.{f.name}")
    try:
        obj = cls(**{k: v for k, v in values.items() if _init_field(cls, k)})
        for k, v in values.items():
            if not _init_field(cls, k):
                setattr(obj, k, v)
        check = getattr(obj, "check", None)
        if check is not None:
            check()
    except (TypeError, ValueError) as exc:
        raise StateError(f"{path}: {exc}") from None
    return obj


def _init_field(cls: type, name: str) -> bool:
    return next(f for f in dataclasses.fields(cls) if f.name == name).init


def _array(data: Any, arrays: dict[str, np.ndarray], path: str) -> np.ndarray:
    if not (isinstance(data, dict) and set(data) == {"$array"} and isinstance(data["$array"], str)):
        raise StateError(f"{path}: expected an array reference, got {_show(data)}")
    arr = arrays.get(data["$array"])
    if arr is None:
        raise StateError(f"{path}: the array {data['$array']!r} is missing")
    if arr.dtype.name not in DTYPES:
        raise StateError(f"{path}: arrays of {arr.dtype} are not state")
    return np.array(arr)  # a writable copy


def pcg64_state(bits: Any, what: str) -> dict[str, Any]:
    """A fresh copy of a PCG64 ``bit_generator.state``, validated: numpy checks neither the increment
    (an even one, 0 say, makes a generator that can loop for ever) nor the ranges; ValueError
    naming ``what`` otherwise."""
    inner = bits.get("state") if isinstance(bits, dict) else None
    ok = (isinstance(inner, dict) and set(bits) == {"bit_generator", "state", "has_uint32", "uinteger"}
          and bits["bit_generator"] == "PCG64" and set(inner) == {"state", "inc"}
          and all(type(v) is int and 0 <= v < 2**128 for v in inner.values()) and inner["inc"] % 2 == 1
          and type(bits["has_uint32"]) is int and bits["has_uint32"] in (0, 1)
          and type(bits["uinteger"]) is int and 0 <= bits["uinteger"] < 2**32)
    if not ok:
        raise ValueError(f"{what} is not a PCG64 generator state (or one numpy cannot draw from)")
    return {"bit_generator": "PCG64", "state": {"state": inner["state"], "inc": inner["inc"]},
            "has_uint32": bits["has_uint32"], "uinteger": bits["uinteger"]}


def _generator(data: Any, path: str) -> np.random.Generator:
    state = data.get("$rng") if isinstance(data, dict) and set(data) == {"$rng"} else None
    try:
        state = pcg64_state(state, path)
    except ValueError as exc:
        raise StateError(str(exc)) from None
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = state
    return rng


def _plain(data: Any, path: str, depth: int = 0) -> Any:
    """A plain JSON value (history rows, metrics, configs; bytes allowed): no arrays or generators."""
    if depth > 32:
        raise StateError(f"{path}: nested too deeply")
    if isinstance(data, (bool, int, float, str)) or data is None:
        return data
    if isinstance(data, list):
        return [_plain(v, path, depth + 1) for v in data]
    if isinstance(data, dict):
        if set(data) == {"$bytes"}:
            return decode(bytes, data, {}, path)
        if any(k.startswith("$") for k in data):
            raise StateError(f"{path}: unexpected {sorted(data)[0]!r}")
        return {k: _plain(v, f"{path}.{k}", depth + 1) for k, v in data.items()}
    raise StateError(f"{path}: unexpected {_show(data)}")


def _show(data: Any) -> str:
    text = repr(data)
    return text if len(text) <= 40 else text[:39] + "…"

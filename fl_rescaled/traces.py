"""Per-client data of a population: trace files, and checks of per-client parameter arrays.

Two kinds of file, each as CSV or JSON (the suffix ``.csv`` or ``.json`` decides; docs/population.md
describes them): compute-time traces (``client,duration``, rows in job order per client) and
availability traces (``client,start,end``, one row per online interval ``[start, end)``). Readers
parse plain text only (numpy for CSV, :mod:`json` for JSON), refuse files over a size limit before
reading them, validate every value and raise ``ValueError`` with one line naming the offending row.
They return compact arrays: every client's values concatenated in client order plus ``offsets``
(length N + 1; client i's values are ``values[offsets[i]:offsets[i + 1]]``).

The models of :mod:`fl_rescaled.delays`, :mod:`fl_rescaled.speeds` and :mod:`fl_rescaled.availability`
take their per-client parameters (one number, or one per client) through :func:`per_client`.
"""

from __future__ import annotations

import io
import json
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

#: Largest CSV file a reader accepts (bytes); ``max_bytes=`` overrides it.
MAX_CSV_BYTES = 256 * 2**20
#: Largest JSON file a reader accepts (bytes): parsed JSON takes ~10× its size in memory.
MAX_JSON_BYTES = 64 * 2**20
#: Most clients a trace may name (client ids run from 0 to N - 1).
MAX_CLIENTS = 10_000_000

DURATIONS_HEADER = ("client", "duration")
AVAILABILITY_HEADER = ("client", "start", "end")
_JSON_KEYS = {"clients", "num_clients", "description"}


def read_durations(path: str | os.PathLike, *, num_clients: int | None = None,
                   max_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Read a compute-time trace: ``(values, offsets)``, client i's durations in job order.

    Parameters
    ----------
    path : str or path-like
        A ``.csv`` file with header ``client,duration`` or a ``.json`` file
        ``{"clients": {"0": [d1, d2, ...], ...}, "num_clients": N}`` (``num_clients`` optional).
    num_clients : int, optional
        N; inferred as the largest client id + 1 when omitted. Every client 0..N-1 needs at least
        one duration; durations must be positive and finite.
    max_bytes : int, optional
        Refuse larger files (default :data:`MAX_CSV_BYTES` or :data:`MAX_JSON_BYTES`).
    """
    clients, cols, where, n = _read(path, DURATIONS_HEADER, num_clients, max_bytes)
    dur = cols[:, 0]
    _first_bad(path, ~(np.isfinite(dur) & (dur > 0)), where, "a duration must be positive and finite")
    order = np.argsort(clients, kind="stable")
    counts = np.bincount(clients, minlength=n)
    if n and counts.min() == 0:
        raise ValueError(f"{path}: client {int(np.argmin(counts))} has no durations (clients 0..{n - 1} need one each)")
    return dur[order], np.concatenate(([0], np.cumsum(counts))).astype(np.int64)


def read_availability(path: str | os.PathLike, *, num_clients: int | None = None,
                      max_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read an availability trace: ``(starts, ends, offsets)``, client i's online intervals sorted.

    Intervals are half-open ``[start, end)``: online at ``start``, offline at ``end``. Rows may come
    in any order; the reader sorts them by client and start, merges intervals that touch (one ends
    where the next starts) and refuses intervals of one client that overlap. A client with no row
    is never online.

    Parameters
    ----------
    path : str or path-like
        A ``.csv`` file with header ``client,start,end`` or a ``.json`` file
        ``{"clients": {"0": [[start, end], ...], ...}, "num_clients": N}`` (``num_clients`` optional).
    num_clients : int, optional
        N; inferred as the largest client id + 1 when omitted.
    max_bytes : int, optional
        Refuse larger files (default :data:`MAX_CSV_BYTES` or :data:`MAX_JSON_BYTES`).
    """
    clients, cols, where, n = _read(path, AVAILABILITY_HEADER, num_clients, max_bytes)
    start, end = cols[:, 0], cols[:, 1]
    _first_bad(path, ~(np.isfinite(start) & np.isfinite(end)), where, "times must be finite")
    _first_bad(path, ~(start < end), where, "an interval needs start < end")
    order = np.lexsort((start, clients))
    c, s, e = clients[order], start[order], end[order]
    same = c[1:] == c[:-1]
    clash = np.flatnonzero(same & (s[1:] < e[:-1]))
    if clash.size:
        k = clash[0]
        raise ValueError(f"{path}: {where(order[k + 1])} overlaps {where(order[k])} (client {c[k]}): intervals of "
                         "a client must not overlap")
    keep = np.concatenate(([True], ~(same & (s[1:] == e[:-1]))))  # a row that touches its predecessor merges
    first = np.flatnonzero(keep)
    last = np.concatenate((first[1:], [c.size])) - 1
    counts = np.bincount(c[first], minlength=n)
    return s[first], e[last], np.concatenate(([0], np.cumsum(counts))).astype(np.int64)


def write_durations(path: str | os.PathLike, values: np.ndarray, offsets: np.ndarray) -> None:
    """Write a compute-time trace (CSV or JSON by suffix) that :func:`read_durations` reads back."""
    lists = _split(values, offsets)
    if _suffix(path) == ".json":
        _write_json(path, {str(i): [float(x) for x in v] for i, v in enumerate(lists)}, len(lists))
        return
    rows = (f"{i},{float(x)!r}" for i, v in enumerate(lists) for x in v)
    Path(path).write_text("\n".join((",".join(DURATIONS_HEADER), *rows)) + "\n")


def write_availability(path: str | os.PathLike, starts: np.ndarray, ends: np.ndarray, offsets: np.ndarray) -> None:
    """Write an availability trace (CSV or JSON by suffix) that :func:`read_availability` reads back."""
    s, e = _split(starts, offsets), _split(ends, offsets)
    if _suffix(path) == ".json":
        _write_json(path, {str(i): [[float(a), float(b)] for a, b in zip(si, ei)] for i, (si, ei) in
                           enumerate(zip(s, e))}, len(s))
        return
    rows = (f"{i},{float(a)!r},{float(b)!r}" for i, (si, ei) in enumerate(zip(s, e)) for a, b in zip(si, ei))
    Path(path).write_text("\n".join((",".join(AVAILABILITY_HEADER), *rows)) + "\n")


def write_example_traces(folder: str | os.PathLike, *, num_clients: int = 20, seed: int = 0,
                         jobs: int = 6, horizon: float = 100.0) -> list[Path]:
    """Write small example traces: ``durations.{csv,json}`` and ``availability.{csv,json}``.

    Durations: ``jobs`` lognormal draws (σ = 0.5) per client around τ_i = 1, 1, 2, 2, 4, 4, 8, 8, 16,
    16, ... (rounded to 3 decimals). Availability: from time 0 to ``horizon``, alternating online and
    offline sessions of Exp(mean 8) lengths (at least 0.5, rounded to 0.1), every client starting
    offline for a random time. Returns the paths written.
    """
    rng = np.random.default_rng((seed, 0xE8A))
    taus = 2.0 ** ((np.arange(num_clients) // 2) % 5)
    dur = np.round(taus[:, None] * rng.lognormal(-0.125, 0.5, (num_clients, jobs)), 3)
    dur = np.maximum(dur, 0.001).ravel()
    d_off = np.arange(0, num_clients * jobs + 1, jobs)
    starts, ends, counts = [], [], []
    for _ in range(num_clients):
        t, k = float(np.round(rng.uniform(0, 8), 1)), 0
        while True:
            on = t + max(0.5, float(np.round(rng.exponential(8.0), 1)))
            if on > horizon:
                break
            starts.append(t)
            ends.append(on)
            t, k = on + max(0.5, float(np.round(rng.exponential(8.0), 1))), k + 1
        counts.append(k)
    a_off = np.concatenate(([0], np.cumsum(counts)))
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for suffix in (".csv", ".json"):
        paths.append(out / f"durations{suffix}")
        write_durations(paths[-1], dur, d_off)
        paths.append(out / f"availability{suffix}")
        write_availability(paths[-1], np.round(starts, 1), np.round(ends, 1), a_off)
    return paths


# -------------------------------------------------------------------------------- per-client parameters


def per_client(value, n: int, name: str, *, low: float = 0.0, strict: bool = True,
               high: float = math.inf) -> np.ndarray:
    """``value`` (a number or N numbers) as a float64 array of length ``n``, each finite in the range.

    ``strict``: values must exceed ``low`` (else be at least ``low``); all must be at most ``high``.
    A number becomes a read-only broadcast view (no N-sized copy).
    """
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.broadcast_to(arr, (n,))
    elif arr.shape != (n,):
        raise ValueError(f"{name} needs one number or {n} numbers, got shape {arr.shape}")
    ok = np.isfinite(arr) & ((arr > low) if strict else (arr >= low)) & (arr <= high) if n else np.ones(0, bool)
    if not ok.all():
        k = int(np.argmin(ok))
        raise ValueError(f"{name}[{k}] = {arr[k]!r} is outside {'(' if strict else '['}{low}, {high}]")
    return arr


def summary(arr: np.ndarray) -> float | dict:
    """A per-client parameter for a report: the number when all agree, else min/mean/max."""
    if arr.size and np.all(arr == arr[0]):
        return float(arr[0])
    return {"min": float(arr.min()), "mean": float(arr.mean()), "max": float(arr.max())} if arr.size else {}


def subset(n: int, *, clients: Sequence[int] | None = None, fraction: float | None = None,
           seed: int = 0) -> np.ndarray:
    """Boolean mask of the affected clients: the ids given, a random ``fraction`` of them (exactly
    ``round(fraction * n)``, drawn from ``seed``), or all when neither is given."""
    if clients is not None and fraction is not None:
        raise ValueError("give clients or fraction, not both")
    mask = np.zeros(n, dtype=bool)
    if clients is not None:
        ids = np.asarray(clients, dtype=np.int64).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            raise ValueError(f"client ids must be in 0..{n - 1}")
        mask[ids] = True
    elif fraction is not None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        mask[np.random.default_rng((seed, 0x5E1EC7)).permutation(n)[: round(fraction * n)]] = True
    else:
        mask[:] = True
    return mask


# ----------------------------------------------------------------------------------------------- reading


def _suffix(path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in (".csv", ".json"):
        raise ValueError(f"{path}: a trace file ends in .csv or .json")
    return suffix


def _read(path, header, num_clients, max_bytes):
    """(client ids int64, values (rows, len(header) - 1) float64, row → description, N)."""
    suffix = _suffix(path)
    limit = max_bytes if max_bytes is not None else (MAX_JSON_BYTES if suffix == ".json" else MAX_CSV_BYTES)
    size = os.stat(path).st_size
    if size > limit:
        raise ValueError(f"{path}: {size} bytes is over the limit of {limit} bytes for a trace file")
    try:
        text = Path(path).read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if suffix == ".csv":
        ids, cols, where = _parse_csv(path, text, header)
    else:
        ids, cols, where, num_clients = _parse_json(path, text, len(header) - 1, num_clients)
    ids, n = _check_clients(path, ids, where, num_clients)
    return ids, cols, where, n


def _parse_csv(path, text: str, header: tuple[str, ...]):
    text = text.replace("\r\n", "\n")
    first, _, body = text.partition("\n")
    got = tuple(x.strip() for x in first.split(","))
    if got != header:
        raise ValueError(f"{path}: line 1 must be the header {','.join(header)!r}, got {first[:60]!r}")
    body = body.rstrip("\n")
    width = len(header)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an empty body: checked below
            table = np.loadtxt(io.StringIO(body), delimiter=",", comments=None, ndmin=2, dtype=np.float64)
    except ValueError as e:
        raise ValueError(f"{path}: {_bad_line(body, width) or str(e).splitlines()[0]}") from None
    if table.size == 0:
        table = np.zeros((0, width))
    if body and len(table) != body.count("\n") + 1:  # numpy skipped a blank line: rows would not match lines
        blank = next((i for i, line in enumerate(body.split("\n")) if not line.strip()), -1)
        raise ValueError(f"{path}: line {blank + 2} is blank")
    if table.shape[1] != width:
        raise ValueError(f"{path}: line 2: expected {width} comma-separated numbers ({','.join(header)})")
    return table[:, 0], table[:, 1:], lambda k: f"line {int(k) + 2}"


def _bad_line(body: str, width: int) -> str | None:
    """Describe the first line that is not ``width`` comma-separated numbers (the error path only)."""
    for i, line in enumerate(body.split("\n")):
        parts = line.split(",")
        try:
            ok = len(parts) == width and "_" not in line and [float(p) for p in parts] is not None
        except ValueError:
            ok = False
        if not ok:
            return f"line {i + 2}: expected {width} comma-separated numbers, got {line[:60]!r}"
    return None


def _parse_json(path, text: str, width: int, num_clients):
    def pairs(items):
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{path}: a key appears twice in one JSON object")
        return dict(items)

    def refuse(name):
        raise ValueError(f"{path}: {name} is not a number JSON allows")

    try:
        doc = json.loads(text, object_pairs_hook=pairs, parse_constant=refuse)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("clients"), dict) or set(doc) - _JSON_KEYS:
        raise ValueError(f"{path}: expected an object with keys 'clients' (an object) and optionally "
                         f"'num_clients', 'description'")
    declared = doc.get("num_clients")
    if declared is not None:
        if type(declared) is not int or declared < 0:
            raise ValueError(f"{path}: num_clients must be a non-negative integer")
        if num_clients is not None and num_clients != declared:
            raise ValueError(f"{path}: the file has num_clients={declared}, {num_clients} were asked for")
        num_clients = declared
    ids, arrays, names = [], [], []
    for key, value in doc["clients"].items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12 or str(int(key)) != key:
            raise ValueError(f"{path}: client key {key[:20]!r} is not a client id (0, 1, 2, ...)")
        arr = _numbers(value, width)
        if arr is None:
            shape = "a list of numbers" if width == 1 else f"a list of [{', '.join(['x'] * width)}] pairs"
            raise ValueError(f"{path}: client {key}: expected {shape}")
        arrays.append(arr)
        ids.append(np.full(len(arrays[-1]), int(key), dtype=np.int64))
        names.append((int(key), len(arrays[-1])))
    cols = np.concatenate(arrays) if arrays else np.zeros((0, width))
    ends = np.cumsum([m for _, m in names])

    def where(k):
        j = int(np.searchsorted(ends, k, side="right"))
        return f"client {names[j][0]}, entry {int(k) - (ends[j] - names[j][1]) + 1}"

    return np.concatenate(ids) if ids else np.zeros(0), cols, where, num_clients


def _numbers(value, width: int) -> np.ndarray | None:
    """A JSON list as a (rows, width) float64 array, or None when it has another shape or non-numbers."""
    if not isinstance(value, list):
        return None
    if not value:
        return np.zeros((0, width))
    try:
        arr = np.array(value)
    except ValueError:  # ragged
        return None
    if arr.dtype.kind not in "iuf" or arr.shape[1:] != (() if width == 1 else (width,)):
        return None
    return arr.astype(np.float64).reshape(-1, width)


def _check_clients(path, ids: np.ndarray, where, num_clients) -> tuple[np.ndarray, int]:
    _first_bad(path, ~(np.isfinite(ids) & (ids == np.floor(ids)) & (ids >= 0)), where,
               "a client id is a non-negative integer")
    _first_bad(path, ids >= MAX_CLIENTS, where, f"client ids must stay below {MAX_CLIENTS}")
    ids = ids.astype(np.int64)
    if num_clients is None:
        if ids.size == 0:
            raise ValueError(f"{path}: no rows, and no number of clients given")
        num_clients = int(ids.max()) + 1
    elif not 0 < int(num_clients) <= MAX_CLIENTS:
        raise ValueError(f"{path}: the number of clients must be in 1..{MAX_CLIENTS}, got {num_clients}")
    _first_bad(path, ids >= num_clients, where, f"client id out of range 0..{int(num_clients) - 1}")
    return ids, int(num_clients)


def _first_bad(path, bad: np.ndarray, where, message: str) -> None:
    hits = np.flatnonzero(bad)
    if hits.size:
        raise ValueError(f"{path}: {where(hits[0])}: {message}")


def _split(values, offsets) -> list[np.ndarray]:
    values, offsets = np.asarray(values, dtype=np.float64), np.asarray(offsets, dtype=np.int64)
    return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def _write_json(path, clients: dict, n: int) -> None:
    rows = ",\n".join(f'    "{key}": {json.dumps(value, separators=(",", ":"))}' for key, value in clients.items())
    Path(path).write_text(f'{{\n  "num_clients": {n},\n  "clients": {{\n{rows}\n  }}\n}}\n')

"""Files a run writes: its final model and summary (``save_model``), and its whole state, to resume
it (a run-state checkpoint, ``write_state``; "checkpoint" means only this).

A final model is two files with one stem: ``<stem>.npz`` (the flat model, ``allow_pickle`` never
needed) and ``<stem>.json`` (the run's outcome without its history). ``load_model`` refuses a
model whose size does not match the summary.

A run-state checkpoint (``write_state``/``read_state``) is one file of data only: an uncompressed
zip holding ``header.json`` (format, state version, the run's fingerprint, the arrays' names),
``state.json`` (the run's state as JSON, ``fl_rescaled.runstate``) and one ``.npy`` per array. It is
written atomically (a run killed while writing leaves the previous checkpoint intact, and the next
write or read removes the temporary file it left). Reading executes nothing the file says (no
pickle, no import) and checks, before the state is used, that the file is whole (the zip's CRCs),
of this format and state version, of this run (fingerprint), and that every array has a plain
dtype and the size its header declares; the state itself is then checked against its schema
(``fl_rescaled.codec``). Anything else is refused with a one-line ``CheckpointError``.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from .codec import DTYPES


def _file_mode() -> int:
    """0o666 minus the process umask (read once, at import, before any thread could race on it)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


_FILE_MODE = _file_mode()


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``path``; on success it replaces ``path`` in one step.

    Readers never see a half-written file, and a failure leaves ``path`` as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _FILE_MODE)  # mkstemp's file is private (0600); a plain open() would obey the umask
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_model(stem: str | Path, params: np.ndarray, summary: dict[str, Any]) -> tuple[Path, Path]:
    """Write a run's final model and its summary as ``<stem>.npz`` and ``<stem>.json``, atomically."""
    stem = Path(stem)
    model_path, meta_path = _beside(stem, ".npz"), _beside(stem, ".json")
    flat = np.ascontiguousarray(params).reshape(-1)
    meta = {k: v for k, v in summary.items() if k not in ("history", "final_model")}
    meta["model_size"] = int(flat.size)
    meta["model_dtype"] = str(flat.dtype)
    with atomic_path(model_path) as tmp, tmp.open("wb") as fh:
        np.savez(fh, model=flat)
    with atomic_path(meta_path) as tmp:
        tmp.write_text(json.dumps(meta, default=float, indent=1))
    return model_path, meta_path


def _beside(stem: Path, suffix: str) -> Path:
    """``stem`` + ``suffix``, whatever dots the stem has (``with_suffix`` would cut ``lr0.05`` to ``lr0``)."""
    return stem.with_name(stem.name + suffix)


def load_model(stem: str | Path) -> tuple[np.ndarray, dict[str, Any]]:
    """The final model and summary ``save_model`` wrote under ``stem``."""
    stem = Path(stem)
    meta = json.loads(_beside(stem, ".json").read_text())
    with np.load(_beside(stem, ".npz"), allow_pickle=False) as z:
        model = z["model"]
    if model.ndim != 1 or model.size != int(meta["model_size"]):
        raise ValueError(f"model {stem}: of size {model.size}, summary says {meta['model_size']}")
    return model, meta


STATE_FORMAT = "fl-rescaled run state"
_OLD_MAGIC = b"fl-rescaled run state\n"  # (format 1: a JSON header line and a pickle; refused)
_ZIP_MAGIC = b"PK\x03\x04"
_MEMBER = re.compile(r"^arrays/(\d{1,9})\.npy$")
#: The most arrays a run state holds (a population's books, models in flight, a strategy's tables).
MAX_ARRAYS = 100_000
#: The largest ``header.json`` and ``state.json`` a run writes, by far (the state of 100,000 clients'
#: run is tens of MB): a member declared larger is refused before it is read.
MAX_JSON_BYTES = {"header.json": 2**24, "state.json": 2**30}


class CheckpointError(ValueError):
    """A run-state checkpoint that cannot be used (missing, corrupted, foreign); one line."""


def write_state(path: str | Path, tree: dict[str, Any], arrays: dict[str, np.ndarray], fingerprint: str,
                version: int) -> Path:
    """Write a run's state (``tree``: JSON-able, ``arrays``: named arrays) for the run ``fingerprint``,
    atomically: a zip of ``header.json``, ``state.json`` and one ``.npy`` per array, uncompressed."""
    path = Path(path)
    names = list(arrays)
    header = {"format": STATE_FORMAT, "version": version, "fingerprint": fingerprint, "arrays": names,
              "written": time.strftime("%Y-%m-%d %H:%M:%S")}
    remove_stale_temporaries(path)
    with atomic_path(path) as tmp:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:
            zf.writestr("header.json", json.dumps(header))
            zf.writestr("state.json", json.dumps(tree))
            for i, name in enumerate(names):
                buf = io.BytesIO()
                np.lib.format.write_array(buf, np.asarray(arrays[name]), allow_pickle=False)
                zf.writestr(f"arrays/{i}.npy", buf.getvalue())
        with tmp.open("rb+") as fh:
            os.fsync(fh.fileno())
    return path


def read_state(path: str | Path, fingerprint: str, version: int) -> tuple[Any, dict[str, np.ndarray]]:
    """The (tree, arrays) that ``write_state`` wrote for the run ``fingerprint``.

    Nothing in the file is executed, imported or unpickled: it is a zip of JSON and ``.npy`` arrays
    of plain dtypes, and anything else is refused with a one-line ``CheckpointError``, before the
    arrays are read: a file of another format (an old pickle included), a damaged or truncated one,
    compressed or unexpected members, another run's, a header that does not match its arrays.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    remove_stale_temporaries(path)
    with path.open("rb") as fh:
        head = fh.read(len(_OLD_MAGIC))
    if head.startswith(_OLD_MAGIC):
        raise CheckpointError(f"{path} was written by an older version of fl-rescaled (a pickle), which this "
                              "version never reads; start the run again")
    if not head.startswith(_ZIP_MAGIC):
        raise CheckpointError(f"{path} is not an fl-rescaled run checkpoint")
    try:
        with zipfile.ZipFile(path) as zf:
            return _read_members(zf, path, fingerprint, version)
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: the checkpoint is corrupted ({type(exc).__name__}: {exc})") from None


def _read_members(zf: zipfile.ZipFile, path: Path, fingerprint: str, version: int):
    infos = zf.infolist()
    if len(infos) > MAX_ARRAYS + 2:
        raise CheckpointError(f"{path}: too many members for a run state")
    for info in infos:
        if info.file_size > MAX_JSON_BYTES.get(info.filename, math.inf):
            raise CheckpointError(f"{path}: {info.filename} declares {info.file_size:,} bytes, more than a run state's "
                                  f"{MAX_JSON_BYTES[info.filename]:,}; it is not read")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{path}: member {info.filename!r} is compressed; a run state never is")
        if info.filename not in ("header.json", "state.json") and not _MEMBER.match(info.filename):
            raise CheckpointError(f"{path}: unexpected member {info.filename!r}")
    header = _json(zf, "header.json", path)
    if not isinstance(header, dict) or header.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{path} is not an fl-rescaled run checkpoint")
    if header.get("version") != version:
        raise CheckpointError(f"{path}: run-state version {header.get('version')!r}; this version of fl-rescaled "
                              f"reads version {version}")
    if header.get("fingerprint") != fingerprint:
        raise CheckpointError(f"{path}: the checkpoint belongs to another run (other settings, strategy or model)")
    names = header.get("arrays")
    members = {info.filename for info in infos}
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names) and len(set(names)) == len(names)
            and members == {"header.json", "state.json", *(f"arrays/{i}.npy" for i in range(len(names)))}):
        raise CheckpointError(f"{path}: the header does not list the arrays the file holds")
    tree = _json(zf, "state.json", path)
    arrays = {name: _array(zf.read(f"arrays/{i}.npy"), path, name) for i, name in enumerate(names)}
    return tree, arrays


def _json(zf: zipfile.ZipFile, member: str, path: Path) -> Any:
    try:
        return json.loads(zf.read(member).decode("utf-8"))
    except KeyError:
        raise CheckpointError(f"{path}: {member} is missing") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: {member} is not valid JSON ({exc})") from None


def _array(data: bytes, path: Path, name: str) -> np.ndarray:
    """One ``.npy`` member: a plain dtype, and exactly as many bytes as its header declares."""
    buf = io.BytesIO(data)
    try:
        major, _ = np.lib.format.read_magic(buf)
        if major not in (1, 2):
            raise ValueError(f".npy version {major}")
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(buf)
    except (ValueError, SyntaxError, TypeError) as exc:
        raise CheckpointError(f"{path}: array {name!r} has a bad header ({exc})") from None
    if dtype.hasobject or dtype.name not in DTYPES or fortran:
        raise CheckpointError(f"{path}: array {name!r} is {dtype}; a run state holds plain C-order arrays")
    if buf.tell() + dtype.itemsize * math.prod(shape) != len(data):
        raise CheckpointError(f"{path}: array {name!r} does not hold the {list(shape)} values its header declares")
    return np.frombuffer(data, dtype=dtype, offset=buf.tell()).reshape(shape)


def remove_stale_temporaries(path: str | Path) -> None:
    """Remove what an interrupted ``atomic_path`` left beside ``path`` (a process killed while writing)."""
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)

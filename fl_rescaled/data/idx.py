"""The IDX file format (LeCun's MNIST files): read and write, optionally gzipped."""

from __future__ import annotations

import gzip
import io
import math
import os
import zlib
from pathlib import Path

import numpy as np

# type code in the third magic byte -> numpy dtype (IDX data is big-endian)
_IDX_CODE_TO_DTYPE = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_KIND_TO_CODE = {
    ("u", 1): 0x08,
    ("i", 1): 0x09,
    ("i", 2): 0x0B,
    ("i", 4): 0x0C,
    ("f", 4): 0x0D,
    ("f", 8): 0x0E,
}


def _read_maybe_gzip(path: Path, max_bytes: int | None = None) -> bytes:
    """The file's bytes, gunzipped if they are gzip; more than ``max_bytes`` (on disk or
    decompressed) is refused before it is read."""
    size = path.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"{path}: {size} bytes, more than the {max_bytes} expected")
    with open(path, "rb") as fh:
        raw = fh.read() if max_bytes is None else fh.read(max_bytes + 1)
    if raw[:2] == b"\x1f\x8b":
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as gz:
                data = gz.read() if max_bytes is None else gz.read(max_bytes + 1)
        except (OSError, EOFError, ValueError, zlib.error) as exc:  # BadGzipFile is an OSError
            raise ValueError(f"{path}: corrupt gzip data ({exc})") from exc
        if max_bytes is not None and len(data) > max_bytes:
            raise ValueError(f"{path}: decompresses to more than the {max_bytes} bytes expected")
        return data
    if path.name.endswith(".gz"):
        raise ValueError(f"{path}: name ends in .gz but content is not gzip")
    if max_bytes is not None and len(raw) > max_bytes:  # (the file grew since stat)
        raise ValueError(f"{path}: more than the {max_bytes} bytes expected")
    return raw


def read_idx(path: str | os.PathLike, *, max_bytes: int | None = None) -> np.ndarray:
    """Read an IDX file (optionally gzipped) into an array of its stored shape.

    Raises ValueError if the magic number, the dimension header or the payload
    size is inconsistent, or (``max_bytes``) if the file or its decompressed
    content is larger: such a file is refused before more than that is read.
    Multi-byte types are returned in native byte order.
    """
    path = Path(path)
    data = _read_maybe_gzip(path, max_bytes)
    if len(data) < 4:
        raise ValueError(f"{path}: too short for an IDX header ({len(data)} bytes)")
    if data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: bad IDX magic {data[:4].hex()} (first two bytes must be zero)")
    code, ndim = data[2], data[3]
    if code not in _IDX_CODE_TO_DTYPE:
        raise ValueError(f"{path}: unknown IDX type code 0x{code:02x}")
    if ndim == 0:
        raise ValueError(f"{path}: IDX file declares zero dimensions")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise ValueError(f"{path}: truncated IDX header ({len(data)} < {header_len} bytes)")
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_CODE_TO_DTYPE[code]
    expected = header_len + math.prod(dims) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(
            f"{path}: IDX size mismatch: header says {dims} of {dtype} "
            f"({expected} bytes in total) but the file holds {len(data)} bytes"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header_len).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file; gzip-compressed if ``path`` ends with ``.gz``.

    Intended for uint8 data (the MNIST case); int8/int16/int32/float32/float64
    are accepted too since the format defines them.
    """
    path = Path(path)
    arr = np.asarray(array)
    key = (arr.dtype.kind, arr.dtype.itemsize)
    if key not in _IDX_KIND_TO_CODE:
        raise ValueError(f"dtype {arr.dtype} cannot be stored in an IDX file")
    if arr.ndim == 0 or arr.ndim > 255:
        raise ValueError(f"IDX needs 1..255 dimensions, got {arr.ndim}")
    if any(d >= 2**32 for d in arr.shape):
        raise ValueError(f"dimension too large for IDX: {arr.shape}")
    code = _IDX_KIND_TO_CODE[key]
    header = bytes([0, 0, code, arr.ndim]) + np.asarray(arr.shape, dtype=">u4").tobytes()
    payload = np.ascontiguousarray(arr, dtype=_IDX_CODE_TO_DTYPE[code]).tobytes()
    blob = header + payload
    if path.name.endswith(".gz"):
        blob = gzip.compress(blob, mtime=0)
    path.write_bytes(blob)

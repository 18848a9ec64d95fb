"""The MNIST cache ``mnist.npz``: written atomically, read only once its layout has been checked.

Anyone could have put the file there, so :func:`read_cache` trusts nothing in it and decides from
small reads whether to go on, before anything the size of the data is allocated:

1. it is a regular file no larger than a full cache can be;
2. its zip end record lists exactly four members in a small central directory, with no zip64
   record (a cache is far below zip64's sizes), so the directory ``zipfile`` then parses is small;
3. the members are ``train_x.npy``, ``train_y.npy``, ``test_x.npy`` and ``test_y.npy``, stored or
   deflated, not encrypted, each declaring an uncompressed size its array can have;
4. each member's ``.npy`` header (format 1.0 or 2.0, at most 4 KiB) declares uint8 pixels or
   integer labels (never an object dtype) and MNIST's shape, and the member holds exactly that.

Only then are the arrays read (``numpy.frombuffer`` on the member's bytes: nothing is unpickled,
no code from the file runs) and checked like every source's data (``check_full_mnist``: labels
in 0..9, 60,000/10,000 images, the standard training class counts).
"""

from __future__ import annotations

import io
import math
import os
import stat
import struct
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np

from .mnist import MNIST_TEST_SIZE, MNIST_TRAIN_SIZE, MnistData, check_full_mnist

#: The arrays of a cache and their shapes (images also as (N, 28, 28)).
CACHE_SHAPES = {
    "train_x": (MNIST_TRAIN_SIZE, 784),
    "train_y": (MNIST_TRAIN_SIZE,),
    "test_x": (MNIST_TEST_SIZE, 784),
    "test_y": (MNIST_TEST_SIZE,),
}
_MAX_HEADER = 4096  # bytes of a .npy header's text (numpy writes about 128)
_MAX_LABEL_BYTES = 8  # widest label dtype accepted (int64)
_PREAMBLE = 6 + 2 + 4  # magic string, version, header length (4 bytes in format 2.0)
_MAX_DIRECTORY = 4096  # bytes of the zip central directory (four entries take about 400)
_EOCD, _EOCD_SIZE, _ZIP64_LOCATOR = b"PK\x05\x06", 22, b"PK\x06\x07"
_MAX_COMMENT = 0xFFFF


def _member_limit(key: str) -> int:
    """The most uncompressed bytes member ``key`` may declare."""
    itemsize = 1 if key.endswith("_x") else _MAX_LABEL_BYTES
    return _PREAMBLE + _MAX_HEADER + math.prod(CACHE_SHAPES[key]) * itemsize


#: The largest cache file accepted: every member at its largest, plus zip headers and deflate's
#: block overhead on incompressible data.
MAX_CACHE_BYTES = sum(_member_limit(k) for k in CACHE_SHAPES) + (1 << 20)


def read_cache(path: str | os.PathLike) -> MnistData:
    """The MNIST arrays of the cache at ``path``; ValueError (a short reason, without the path)
    if it is not a complete, standard MNIST cache."""
    path = Path(path)
    if not stat.S_ISREG(path.stat().st_mode):  # (before opening: opening a FIFO would wait for a writer)
        raise ValueError("not a regular file")
    try:
        with open(path, "rb") as fh:
            info = os.fstat(fh.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ValueError("not a regular file")
            if info.st_size == 0:
                raise ValueError("empty file")
            if info.st_size > MAX_CACHE_BYTES:
                raise ValueError(f"{info.st_size} bytes, more than a cache can have ({MAX_CACHE_BYTES})")
            _check_end_record(fh, info.st_size)
            fh.seek(0)
            with zipfile.ZipFile(fh) as zf:
                members = _members(zf)
                arrays = {key: _read_member(zf, member, key) for key, member in members.items()}
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
        raise ValueError(f"corrupt zip data ({type(exc).__name__}: {exc})") from exc
    data = MnistData(**arrays, source=f"cache {path}")
    try:
        check_full_mnist(data)
    except ValueError as exc:
        raise ValueError(str(exc).removeprefix(f"{data.source}: ")) from None
    return data


def _check_end_record(fh, size: int) -> None:
    """The zip end record, found as ``zipfile`` finds it, must list four members in a small
    directory and have no zip64 record before it (``zipfile`` would take its sizes instead)."""
    tail_start = max(size - _EOCD_SIZE - _MAX_COMMENT - 1, 0)
    fh.seek(tail_start)
    tail = fh.read()
    if size >= _EOCD_SIZE and tail[-_EOCD_SIZE:][:4] == _EOCD and tail[-2:] == b"\0\0":
        at = len(tail) - _EOCD_SIZE
    else:
        at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < _EOCD_SIZE:
        raise ValueError("not a zip archive (an .npz file is one)")
    _, _, _, here, total, directory, _, _ = struct.unpack("<4s4H2LH", tail[at:at + _EOCD_SIZE])
    if here != len(CACHE_SHAPES) or total != len(CACHE_SHAPES) or directory > _MAX_DIRECTORY:
        raise ValueError(f"the zip directory lists {total} members in {directory} bytes; a cache has "
                         f"{len(CACHE_SHAPES)} members in at most {_MAX_DIRECTORY} bytes")
    record = tail_start + at
    if record >= 20:
        fh.seek(record - 20)
        if fh.read(4) == _ZIP64_LOCATOR:
            raise ValueError("a zip64 archive (a cache is far smaller than zip64's sizes)")


def _members(zf: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo]:
    """The four members by array name, each checked against its largest allowed size."""
    infos = zf.infolist()
    names = sorted(i.filename for i in infos)
    expected = sorted(f"{k}.npy" for k in CACHE_SHAPES)
    if names != expected:
        raise ValueError(f"members {', '.join(names)[:200]}; expected {', '.join(expected)}")
    members = {}
    for i in infos:
        key = i.filename.removesuffix(".npy")
        if i.flag_bits & 0x1:
            raise ValueError(f"{i.filename} is encrypted")
        if i.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise ValueError(f"{i.filename}: compression method {i.compress_type} (stored or deflated only)")
        if i.file_size > _member_limit(key):
            raise ValueError(f"{i.filename} declares {i.file_size} bytes, more than its array can "
                             f"take ({_member_limit(key)})")
        members[key] = i
    return members


def _npy_header(fp, name: str) -> tuple[tuple, bool, np.dtype, int]:
    """(shape, fortran_order, dtype, header bytes) of a .npy stream, its header at most 4 KiB."""
    try:
        version = np.lib.format.read_magic(fp)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"format version {version[0]}.{version[1]} (1.0 or 2.0 expected)")
        width = 2 if version == (1, 0) else 4
        size_bytes = fp.read(width)
        length = int.from_bytes(size_bytes, "little")
        if len(size_bytes) != width or length > _MAX_HEADER:
            raise ValueError(f"a {length}-byte header (at most {_MAX_HEADER})")
        text = fp.read(length)
        reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = reader(io.BytesIO(size_bytes + text), max_header_size=_MAX_HEADER)
    except Exception as exc:  # noqa: BLE001 - whatever the parser trips on, the header is unusable
        raise ValueError(f"{name}: bad .npy header ({' '.join(str(exc).split())[:160]})") from None
    return shape, fortran, dtype, 6 + 2 + width + length


def _read_member(zf: zipfile.ZipFile, member: zipfile.ZipInfo, key: str) -> np.ndarray:
    name = member.filename
    with zf.open(member) as fp:
        shape, fortran, dtype, header = _npy_header(fp, name)
        images = key.endswith("_x")
        if images and dtype != np.uint8:
            raise ValueError(f"{name}: dtype {dtype}, expected uint8 pixels")
        if not images and (dtype.kind not in "iu" or dtype.itemsize > _MAX_LABEL_BYTES):
            raise ValueError(f"{name}: dtype {dtype}, expected integer labels")
        want = CACHE_SHAPES[key]
        if shape != want and not (images and shape == (want[0], 28, 28)):
            raise ValueError(f"{name}: shape {shape}, expected {want}")
        nbytes = math.prod(shape) * dtype.itemsize
        if member.file_size != header + nbytes:
            raise ValueError(f"{name}: {member.file_size} bytes, but its header declares {header + nbytes}")
        blob = fp.read(nbytes)
        if len(blob) != nbytes or fp.read(1):  # (reading to the end checks the member's CRC too)
            raise ValueError(f"{name}: {len(blob)} bytes of data, expected {nbytes}")
    arr = np.frombuffer(blob, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    if images:
        return np.array(arr.reshape(shape[0], 784), dtype=np.uint8, order="C")
    return arr.astype(np.int64)


def write_cache(data: MnistData, path: Path) -> None:
    """Write the npz cache atomically (temp file in the same directory, then os.replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".mnist-", suffix=".npz.tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, train_x=data.train_x, train_y=data.train_y, test_x=data.test_x, test_y=data.test_y)
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; the cache is not secret
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise

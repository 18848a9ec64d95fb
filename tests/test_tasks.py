"""Tasks: the hand-written MLP gradient equals autograd's; quadratic gradients and minimisers."""

import numpy as np
import pytest
import torch

from fl_rescaled.tasks import MnistTask, QuadraticTask, build_task, client_rng, mlp_gradient, task_spec


def _minibatch(seed: int, init: int):
    """A model (initialised with seed ``init``) and a random minibatch of 64 images and labels."""
    rng = np.random.default_rng(seed)
    w = torch.from_numpy(MnistTask().initial_params(init))
    xb = torch.from_numpy(rng.standard_normal((64, 784)).astype(np.float32))
    return w, xb, torch.from_numpy(rng.integers(0, 10, 64))


def test_mlp_gradient_matches_autograd(kernel):
    w, xb, yb = _minibatch(0, 3)
    g, loss = mlp_gradient(w, xb, yb)
    w = w.numpy()

    model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    sizes = [p.numel() for p in model.parameters()]
    with torch.no_grad():
        for p, chunk in zip(model.parameters(), np.split(w, np.cumsum(sizes)[:-1])):
            p.copy_(torch.from_numpy(chunk.reshape(p.shape)))
    ref_loss = torch.nn.functional.cross_entropy(model(xb), yb)
    ref_loss.backward()
    ref = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-6)


def test_the_two_kernels_agree_and_each_gives_the_same_bits_wherever_the_rows_lie(monkeypatch):
    import fl_rescaled.tasks.mnist as mnist

    if not mnist.onednn_available():
        pytest.skip("this torch has no oneDNN inner product")
    w, xb, yb = _minibatch(1, 4)
    got = {}
    for flag in (True, False):
        monkeypatch.setattr(mnist, "_ONEDNN", flag)
        got[flag] = mlp_gradient(w, xb, yb)
        for shift in (1, 3, 16):  # the same minibatch and model at other offsets of their buffers
            xs = torch.empty(64 * 784 + shift)[shift:].view(64, 784).copy_(xb)
            ws = torch.empty(w.shape[0] + shift)[shift:].copy_(w)
            g, loss = mlp_gradient(ws, xs, yb)
            if not flag and shift % 16:
                # MKL may take another path for operands off 64-byte boundaries (Intel documents it, and
                # the project aligns what it hands MKL): equal within rounding there, bits at 64 bytes.
                np.testing.assert_allclose(g, got[flag][0], rtol=1e-5, atol=1e-7)
                assert loss == pytest.approx(got[flag][1], rel=1e-6)
                continue
            np.testing.assert_array_equal(g, got[flag][0])
            assert loss == got[flag][1]
            if flag:  # oneDNN's bits do not depend on where the gradient is written either (MKL's may)
                out = torch.empty(w.shape[0] + shift)[shift:]
                np.testing.assert_array_equal(mlp_gradient(ws, xs, yb, out)[0], got[flag][0])
        h = mnist.linear(xb, w[:100352].view(128, 784), w[100352:100480], relu=True)
        assert h.shape == (64, 128) and float(h.min()) == 0.0
        got[flag] += (h,)
    np.testing.assert_allclose(got[True][0], got[False][0], rtol=1e-4, atol=1e-6)
    assert got[True][1] == pytest.approx(got[False][1], rel=1e-6)
    torch.testing.assert_close(got[True][2], got[False][2], rtol=1e-5, atol=1e-5)


def test_onednn_in_a_new_thread_uses_torchs_thread_count_not_every_core(monkeypatch):
    """OpenMP's team size is per thread: a thread that never called ``torch.set_num_threads`` would
    run oneDNN on every core (MKL follows torch's setting). ``linear`` gives the thread torch's."""
    import ctypes
    import threading
    from pathlib import Path

    import fl_rescaled.tasks.mnist as mnist

    if not mnist.onednn_available():
        pytest.skip("this torch has no oneDNN inner product")
    monkeypatch.setattr(mnist, "_ONEDNN", True)
    gomp = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*"))
    if not gomp:
        pytest.skip("this torch ships no libgomp to ask")
    omp = ctypes.CDLL(str(gomp[0]))
    default = torch.get_num_threads()
    torch.set_num_threads(1)
    seen = {}

    def job():
        seen["before"] = omp.omp_get_max_threads()
        mnist.linear(torch.ones(4, 6), torch.ones(3, 6))
        seen["after"] = omp.omp_get_max_threads()

    try:
        thread = threading.Thread(target=job)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(default)
    assert seen["after"] == 1  # (before: OpenMP's default, the cores, 2 on this project's machine)


def test_the_environment_turns_onednn_off(monkeypatch):
    import fl_rescaled.tasks.mnist as mnist

    for off in ("0", " off ", "FALSE", "No"):
        monkeypatch.setattr(mnist, "_ONEDNN", None)
        monkeypatch.setenv("FL_RESCALED_ONEDNN", off)
        assert mnist.onednn() is False, off
    monkeypatch.setattr(mnist, "_ONEDNN", None)
    monkeypatch.setenv("FL_RESCALED_ONEDNN", "1")
    assert mnist.onednn() is hasattr(torch.ops.mkldnn, "_linear_pointwise")


def test_unasked_the_kernel_follows_the_cpu_never_a_clock(monkeypatch, tmp_path):
    """With ``FL_RESCALED_ONEDNN`` unset, oneDNN is the kernel on AMD's family 26 only (where we
    measured it faster), torch's BLAS on Zen 4, Intel, or a machine whose CPU cannot be read; the
    environment overrides either way; and the vendor and family are read from the first CPU's block."""
    import fl_rescaled.tasks.mnist as mnist

    monkeypatch.setattr(mnist, "onednn_available", lambda: True)  # (any torch: the choice alone)
    monkeypatch.delenv("FL_RESCALED_ONEDNN", raising=False)
    for cpu, chosen in ((("AuthenticAMD", 26), True), (("AuthenticAMD", 25), False), (("GenuineIntel", 6), False),
                        (None, False)):
        monkeypatch.setattr(mnist, "_cpu_family", lambda cpu=cpu: cpu)
        for env, want in (("", chosen), ("1", True), ("0", False)):
            monkeypatch.setenv("FL_RESCALED_ONEDNN", env)
            monkeypatch.setattr(mnist, "_ONEDNN", None)
            assert mnist.onednn() is want, (cpu, env)
    monkeypatch.setattr(mnist, "onednn_available", lambda: False)  # (asked for, but this torch has none)
    monkeypatch.setattr(mnist, "_ONEDNN", None)
    assert mnist.onednn() is False
    monkeypatch.undo()
    info = tmp_path / "cpuinfo"
    two = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 17\n\n"
           "processor\t: 1\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n\n")
    for text, want in ((two, ("AuthenticAMD", 26)), ("vendor_id : GenuineIntel\ncpu family : 6\n", ("GenuineIntel", 6)),
                       ("vendor_id\t: AuthenticAMD\ncpu family\t: x1A\n", ("AuthenticAMD", -1)),
                       ("vendor_id\t: AuthenticAMD\n", None), ("", None)):
        info.write_text(text)
        assert mnist._cpu_family(str(info)) == want, text
    assert mnist._cpu_family(str(tmp_path / "none")) is None


def test_a_torch_whose_onednn_op_fails_or_disagrees_computes_with_torch_mm(monkeypatch):
    import fl_rescaled.tasks.mnist as mnist

    class Ops:  # stands for ``torch.ops.mkldnn`` on a torch where the op differs
        def __init__(self, fn):
            self._linear_pointwise = fn

    def wrong_signature(*args):
        raise TypeError("_linear_pointwise() takes 5 arguments")

    def off_by_one(x, w, b, *rest):
        return x @ w.t() + 1.0

    w, xb, yb = _minibatch(2, 5)
    monkeypatch.setattr(mnist, "_ONEDNN", False)
    ref = mlp_gradient(w, xb, yb)
    monkeypatch.setenv("FL_RESCALED_ONEDNN", "1")  # (asked for on any CPU: refused for the op alone)
    for fake in (wrong_signature, off_by_one):
        monkeypatch.setattr(torch.ops, "mkldnn", Ops(fake))
        monkeypatch.setattr(mnist, "_ONEDNN", None)
        monkeypatch.setattr(mnist, "_AVAILABLE", None)
        assert mnist.onednn() is False
        g, loss = mlp_gradient(w, xb, yb)
        np.testing.assert_array_equal(g, ref[0])
        assert loss == ref[1]


def test_mlp_init_matches_pytorch_bounds():
    w = MnistTask().initial_params(0)
    assert w.dtype == np.float32 and w.shape == (101770,)
    assert np.abs(w[:100480]).max() <= 1 / np.sqrt(784) + 1e-7
    assert np.abs(w[100480:]).max() <= 1 / np.sqrt(128) + 1e-7
    assert not np.array_equal(w, MnistTask().initial_params(1))


def test_quadratic_gradient_and_minimizer():
    t = QuadraticTask([1.0, 2.0], [4.0, -3.0], dim=2)
    assert t.minimizer == pytest.approx(-2 / 3)
    g, loss = t.gradient(np.array([1.0, 0.0]), 1, client_rng(0, 1, 0))
    np.testing.assert_allclose(g, [2 * 2 * 4.0, 2 * 2 * 3.0])
    assert loss == pytest.approx(2 * (16 + 9))
    ev = t.evaluate(np.full(2, -2 / 3))
    assert ev["dist"] == pytest.approx(0.0, abs=1e-12) and ev["loss_gap"] == pytest.approx(0.0, abs=1e-9)
    w = QuadraticTask([1.0, 2.0], [4.0, -3.0], weights=[0.75, 0.25])
    assert w.minimizer == pytest.approx((0.75 * 4 - 0.25 * 2 * 3) / (0.75 + 0.5))


def test_noise_is_a_function_of_seed_partition_and_job():
    t = QuadraticTask([1.0], [0.0], dim=3, noise=1.0)
    x = np.zeros(3)
    g1, _ = t.gradient(x, 0, client_rng(5, 0, 9))
    g2, _ = t.gradient(x, 0, client_rng(5, 0, 9))
    g3, _ = t.gradient(x, 0, client_rng(5, 0, 10))
    g4, _ = t.gradient(x, 0, client_rng(5, 1, 9))
    assert np.array_equal(g1, g2)
    assert not np.array_equal(g1, g3) and not np.array_equal(g1, g4)


def test_task_spec_roundtrip():
    cfg = {"task": "quadratic", "seed": 4, "num-partitions": 2, "quad-a": [1.0, 2.0], "quad-b": [0.0, 1.0]}
    t = build_task(task_spec(cfg))
    assert isinstance(t, QuadraticTask) and t.seed == 4 and t.minimizer == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        build_task({"task": "cifar"})


def test_the_studies_machine_row_names_the_cpu_family_and_the_kernel(monkeypatch, tmp_path):
    """The kernel now depends on the CPU's family, so a study's machine row records both (the reports
    print them; an older row without them still prints)."""
    import fl_rescaled.tasks.mnist as mnist
    from fl_rescaled.paper.timing import family_label, machine_info
    from fl_rescaled.settings import cpu_info

    for flag, name in ((True, "oneDNN"), (False, "torch's BLAS")):
        monkeypatch.setattr(mnist, "_ONEDNN", flag)
        assert machine_info(1, 2)["kernel"] == name
    info = cpu_info()
    assert machine_info(1, 2)["cpu_family"] == " ".join(info[k] for k in ("vendor_id", "cpu family") if k in info)
    assert family_label({"cpu_family": "AuthenticAMD 26"}) == " (AuthenticAMD family 26)"
    assert family_label({}) == family_label({"cpu_family": "AuthenticAMD"}) == ""
    assert cpu_info(str(tmp_path / "none")) == {}
    (tmp_path / "cpuinfo").write_text("\n\nvendor_id : X\nmodel name : A: B\n\nvendor_id : Y\n")
    assert cpu_info(str(tmp_path / "cpuinfo")) == {"vendor_id": "X", "model name": "A: B"}


def _synthetic_mnist(parts: int = 5, seed: int = 0) -> MnistTask:
    """An MNIST task whose partitions and test set are random images (no data file read)."""
    rng = np.random.default_rng(seed)
    task = MnistTask(num_partitions=parts)

    def images(n):
        return (torch.from_numpy(rng.standard_normal((n, 784)).astype(np.float32)),
                torch.from_numpy(rng.integers(0, 10, n)))

    task._parts = [images(int(n)) for n in rng.integers(300, 900, parts)]
    task._test = images(700)
    return task


def test_an_evaluation_spread_over_threads_gives_the_bits_of_one_after_another(kernel, monkeypatch):
    import threading

    import fl_rescaled.tasks.mnist as mnist

    task = _synthetic_mnist()
    x = task.initial_params(1)
    monkeypatch.setattr(mnist, "available_cores", lambda: 1)
    alone = task.evaluate(x)
    assert len(alone["client_losses"]) == 5 and 0 <= alone["accuracy"] <= 1
    names, seen, lock, both = set(), [], threading.Lock(), threading.Barrier(2, timeout=30)
    real = mnist.linear

    def spy(*args, **kw):  # (the first two calls wait for each other: on one thread this would time out)
        with lock:
            names.add(threading.current_thread().name)
            seen.append(1)
            first_two = len(seen) <= 2
        if first_two:
            both.wait()
        return real(*args, **kw)

    monkeypatch.setattr(mnist, "linear", spy)
    monkeypatch.setattr(mnist, "available_cores", lambda: 3)
    default = torch.get_num_threads()
    torch.set_num_threads(1)  # (as in every run: each op on its calling thread)
    try:
        spread = task.evaluate(x)
    finally:
        torch.set_num_threads(default)
    assert spread == alone  # every loss and the accuracy, to the bit
    assert len(names) > 1 and all(n.startswith("fl-rescaled-eval") for n in names)


def test_side_by_side_keeps_the_order_raises_and_stays_on_one_thread_with_torch_threads(monkeypatch):
    import threading

    import fl_rescaled.tasks.mnist as mnist

    monkeypatch.setattr(mnist, "available_cores", lambda: 4)
    default = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        both = threading.Barrier(2, timeout=30)  # (two calls waiting for each other: two threads or a timeout)
        assert len(set(mnist.side_by_side([(lambda: (both.wait(), threading.current_thread().name)[1],)] * 2))) == 2
    finally:
        torch.set_num_threads(default)
    assert mnist.side_by_side([(pow, k, 2) for k in range(20)]) == [k * k for k in range(20)]
    with pytest.raises(ZeroDivisionError):
        mnist.side_by_side([(divmod, 1, 1), (divmod, 1, 0)])
    default = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert set(mnist.side_by_side([(lambda: threading.current_thread().name,)] * 3)) == {
            threading.current_thread().name}
    finally:
        torch.set_num_threads(default)


def test_huge_empty_gives_a_writable_aligned_array_or_plain_memory(monkeypatch):
    """``huge_empty``: the asked shape and dtype, writable, starting on a huge page when it is at least
    one (the MNIST images); below one page, or without the advice (not Linux), plain ``np.empty``."""
    import mmap

    from fl_rescaled.tasks import base

    big = base.huge_empty((3000, 784), np.float32)
    assert big.shape == (3000, 784) and big.dtype == np.float32 and big.flags.writeable and big.flags.c_contiguous
    assert big.ctypes.data % base.HUGE_PAGE == 0
    big[...] = 1.5
    assert float(big.sum()) == 1.5 * big.size
    small = base.huge_empty((10, 784), np.float32)
    assert small.shape == (10, 784) and small.base is None  # (its own memory: np.empty)
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    plain = base.huge_empty((3000, 784), np.float32)
    assert plain.shape == (3000, 784) and plain.base is None


@pytest.mark.mnist
def test_the_partitions_are_views_of_the_images_laid_end_to_end(mnist_cache):
    """``MnistTask.images``: every partition's images in partition order, in one buffer of which the
    partitions are views; the worker's and the batches' data (``device_data``) is that same tensor,
    not a second copy of the 170 MB."""
    from fl_rescaled.tasks.batched import device_data

    task = MnistTask(num_partitions=7, seed=3)
    images = task.images()
    row = 0
    for i in range(7):
        x, y = task.partition(i)
        assert x.data_ptr() == images[row].data_ptr() and torch.equal(x, images[row:row + len(y)])
        row += len(y)
    assert row == images.shape[0]
    X, _, starts, _ = device_data(task, "cpu")
    assert X.data_ptr() == images.data_ptr() and starts.tolist()[1] == len(task.partition(0)[1])
    synthetic = _synthetic_mnist()  # (partitions given directly: laid end to end on first use)
    assert torch.equal(synthetic.images(), torch.cat([x for x, _ in synthetic._parts]))

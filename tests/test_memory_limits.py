"""Impossible sizes are refused before anything is allocated (issue #16, class 4): a pass's output,
an epoch's order and a batch are checked against what the host (or GPU) has, and too large is a
ValueError naming the size and the limit; train.py exits 2 with that one line."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from minitorch_fft import backends
import minitorch_fft as mt
from minitorch_fft.backends import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
f32 = np.float32
BIG = 2**20   # planes or pixels: BIG x BIG float32 is 4 TiB, more than any machine here has


# Each pass of each backend, given inputs of a few MiB whose output would take terabytes.
HUGE_PASSES = [
    ("fprop", lambda b: b.fprop(np.ones((1, 1, 1, 1), f32), np.ones((1, 1, 1, 1), f32), padding=BIG // 2)),
    ("bprop", lambda b: b.bprop(np.ones((BIG, 1, 1, 1), f32), np.ones((1, BIG, 1, 1), f32), (BIG, BIG, 1, 1))),
    ("accgrad", lambda b: b.accgrad(np.ones((1, BIG, 1, 1), f32), np.ones((1, BIG, 1, 1), f32), (BIG, BIG, 1, 1))),
]


@pytest.mark.parametrize("backend", backends.names())
@pytest.mark.parametrize("pass_name,call", HUGE_PASSES, ids=[p[0] for p in HUGE_PASSES])
def test_an_output_larger_than_the_machine_is_refused_before_allocating(backend, pass_name, call):
    """Before: gemm and direct asked NumPy for 4 TiB (a MemoryError deep inside; padding 60000 on
    a 1x1 input asked for 53.6 GiB, which overcommitting hosts grant and then run out of)."""
    with pytest.raises(ValueError, match=r"TiB, more than this machine's .* of memory"):
        call(backends.get(backend))


def test_the_issues_padding_60000_names_its_size():
    x, w = np.ones((1, 1, 1, 1), f32), np.ones((1, 1, 1, 1), f32)
    if common.machine_bytes(4 * 120001**2) >= 4 * 120001**2:
        pytest.skip("this machine has more than 53.6 GiB: the pass-time check covers it instead")
    with pytest.raises(ValueError, match=r"\(1, 1, 120001, 120001\).*53\.6 GiB"):
        backends.gemm.fprop(x, w, padding=60000)


def test_a_layer_pass_that_cannot_fit_now_is_refused_and_nothing_runs(monkeypatch):
    """Sizes between free and total memory: run_pass checks the pass's output against what is
    available now (here made 1 KiB, and every size checked), names both, and runs no backend."""
    limit = []
    monkeypatch.setattr(common, "CHECK_ABOVE_BYTES", 0)
    monkeypatch.setattr(common, "available_bytes", lambda xp: (limit.append(1) or 1024, "in the test's limit"))
    ran = []
    monkeypatch.setattr(backends.gemm, "fprop", lambda *a, **k: ran.append(1))
    layer = mt.SpatialConvolution(3, 8, 3, backend="gemm")
    before = layer.weight.data.copy()
    with pytest.raises(ValueError, match=r"fprop's output \(2, 8, 14, 14\).*needs 12\.2 KiB, more than "
                                         r"the 1\.0 KiB in the test's limit"):
        layer(mt.Tensor(np.ones((2, 3, 16, 16), f32)))
    assert ran == [] and len(limit) == 2          # looked again after letting go of scratch
    np.testing.assert_array_equal(layer.weight.data, before)


def test_the_hosts_available_memory_is_the_limit():
    avail, source = common.available_bytes(np)
    assert avail > 0 and "host" in source
    with pytest.raises(ValueError, match=r"an array needs 8\.0 EiB, more than the .* host"):
        common.check_fits(2**63, np, "an array")
    common.check_fits(common.CHECK_ABOVE_BYTES, np, "an array")   # small sizes pass unchecked


@pytest.mark.parametrize("args,pattern", [
    (["--data", "fake", "--fake-size", "10000000000000"],
     r"the order of an epoch of 10,000,000,000,000 images \(8 bytes each\) needs 72\.8 TiB, more than the "),
    (["--data", "fake", "--model", "alexnet", "--fake-size", "100000000", "--batch-size", "100000000"],
     r"a batch of 100,000,000 images of \(3, 224, 224\) float32 needs 54\.8 TiB, more than the "),
])
def test_train_py_refuses_a_data_set_or_batch_that_cannot_fit(args, pattern):
    """Before: a traceback from NumPy asking for 72.8 TiB (exit 1), after building the model."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--no-progress", "--device", "cpu",
                        *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr
    assert re.search(pattern + r".* of memory available on the host", lines[0]), lines[0]


@pytest.mark.parametrize("S,most", [(128, 103), (128, 128), (128, 200), (7, 1), (7, 3), (1, 5), (64, 63), (5, 0)])
def test_batch_slices_are_few_and_even(S, most):
    """A batch cut to fit a workspace: every image once, in order, no slice over `most` (one image
    at least), as few slices as that allows, sizes within one of each other (64 + 64, not 103 + 25)."""
    slices = common.batch_slices(S, most)
    sizes = [sl.stop - sl.start for sl in slices]
    assert [i for sl in slices for i in range(sl.start, sl.stop)] == list(range(S))
    assert max(sizes) <= max(most, 1) and len(slices) == -(-S // max(most, 1))
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.gpu
def test_a_large_output_the_pool_already_holds_is_not_asked_of_the_driver(monkeypatch):
    """check_fits on the GPU: where CuPy's pool holds the bytes unused (and has no limit), the
    driver's free-memory figure is not asked for; otherwise it is, and a size over it is refused."""
    import cupy as cp
    pool = cp.get_default_memory_pool()
    if pool.get_limit():
        pytest.skip("the memory pool has a limit set")
    nbytes = common.CHECK_ABOVE_BYTES + 2**20
    held = cp.empty(nbytes, dtype=cp.uint8)
    del held                                         # back to the pool, unused
    asked = []
    real = common.available_bytes
    monkeypatch.setattr(common, "available_bytes", lambda xp: asked.append(1) or real(xp))
    assert pool.free_bytes() >= nbytes
    common.check_fits(nbytes, cp, "an array")
    assert asked == []
    with pytest.raises(ValueError, match=r"a huge array needs .*, more than the .* free on the GPU"):
        common.check_fits(2**60, cp, lambda: "a huge array")
    assert asked == [1]
    pool.set_limit(size=pool.total_bytes() + 2**30)   # a pool with a limit: the driver is asked
    try:
        common.check_fits(nbytes, cp, "an array")
    finally:
        pool.set_limit(size=0)
    assert asked == [1, 1]


def test_the_output_check_formats_nothing_for_a_small_output(monkeypatch):
    """run_pass's output check returns before it formats its message or asks for free memory
    where the output is at most CHECK_ABOVE_BYTES (the per-call path of every small pass); at
    CHECK_ABOVE_BYTES 0 the same pass is checked, with the output's shape in the message."""
    checked = []
    monkeypatch.setattr(common, "check_fits", lambda nbytes, xp, what: checked.append((nbytes, what())))
    ran = []
    monkeypatch.setattr(backends.gemm, "fprop", lambda *a, **k: ran.append(1))
    x, w = np.ones((2, 3, 16, 16), np.float32), np.ones((8, 3, 3, 3), np.float32)
    run = lambda: backends.run_pass("gemm", "fprop", x, w, x_shape=x.shape, w_shape=w.shape,  # noqa: E731
                                    stride=(1, 1), padding=(0, 0))
    run()
    assert ran == [1] and checked == []
    monkeypatch.setattr(common, "CHECK_ABOVE_BYTES", 0)
    run()
    assert ran == [1, 1] and checked == [(2 * 8 * 14 * 14 * 4, "fprop's output (2, 8, 14, 14) (input (2, 3, 16, 16), "
                                                                "weight (8, 3, 3, 3))")]

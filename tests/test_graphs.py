"""CUDA-graph training steps (minitorch_fft.graphs) and the GPU dropout stream they rely on.

CPU: Philox4x32-10 against Random123's known answers, the dropout stream's properties and its
state in checkpoints, kernels/dropout.cu compiled for the host against the NumPy reference,
cgemm's capture path on a modelled cuBLAS, and the refusals. GPU: the dropout kernel bit for bit
against the NumPy reference; a graphed step against the same steps run eagerly, dropout
included; recapture when what the graph baked in changes."""
import ctypes
import json
import pathlib

import numpy as np
import pytest

import minitorch_fft as mt
from minitorch_fft.backends import cgemm
from minitorch_fft import random as mrandom
from test_cuda_compile import core_gpu_branch, core_host_library
from test_cgemm import CALLS, _Device, _gemm_strided_batched_ex, cublas_model, rand  # noqa: F401


# -- Philox and the dropout stream, on the CPU -------------------------------------------------

@pytest.mark.parametrize("counter, key, expected", [   # Random123's kat_vectors, philox4x32 10
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(v) for v in mrandom.philox4x32(counter, key)) == expected


def test_dropout_stream_keeps_the_right_share_and_differs_per_mask():
    masks = [mrandom.dropout_reference(7, n, 200_000, 0.3) for n in range(3)]
    for m in masks:
        assert abs(m.mean() - 0.7) < 4 * np.sqrt(0.21 / m.size)     # 4 sigma
    assert (masks[0] != masks[1]).mean() > 0.35                      # independent: 2 p (1 - p) = 0.42
    assert not np.array_equal(mrandom.dropout_reference(8, 0, 1000, 0.3), masks[0][:1000])
    np.testing.assert_array_equal(mrandom.dropout_reference(7, 1, 1000, 0.3), masks[1][:1000])


@pytest.fixture(scope="module")
def dropout_cu(tmp_path_factory):
    return core_host_library(tmp_path_factory, "dropout.cu")


@pytest.mark.parametrize("seed, first_mask", [(123, 0), (2**40 + 7, 2**33 + 5)])  # both words
def test_dropout_kernel_on_the_host_matches_the_reference_bit_for_bit(dropout_cu, seed, first_mask):
    """kernels/dropout.cu compiled for the host: the mask is dropout_reference's, y = x * mask,
    and the advance kernel moves the stream on by one mask."""
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)     # noqa: E731
    p, size = 0.4, 3 * 1001
    scale = np.float32(1.0 / (1.0 - p))
    x = np.random.default_rng(0).standard_normal(size, dtype=np.float32)
    state = np.array([seed, first_mask], dtype=np.uint64)
    for n in range(first_mask, first_mask + 3):
        y, m = np.full(size, np.nan, np.float32), np.full(size, np.nan, np.float32)
        dropout_cu.emu_dropout(ptr(x), ptr(state), ctypes.c_float(p), ctypes.c_float(scale), ptr(y), ptr(m),
                               ctypes.c_ulonglong(size), 5, 64)   # 5 x 64 threads: a grid-stride loop
        keep = mrandom.dropout_reference(seed, n, size, p)
        np.testing.assert_array_equal(m, np.where(keep, scale, np.float32(0)))
        np.testing.assert_array_equal(y, x * m)
        dropout_cu.emu_advance(ptr(state), 1, 1)
        assert state.tolist() == [seed, n + 1]


def test_gpu_dropout_run_on_the_host_matches_the_reference(dropout_cu, monkeypatch):
    """random.dropout_mask's GPU branch on a fake CuPy (test_cuda_compile.core_gpu_branch): the
    kernels get arguments of their C types, the state advances on the device, masks n = 0, 1, 2
    are dropout_reference's, bit for bit."""
    for name, value in (("_gpu_states", {}), ("_pending", {}), ("_rng", mrandom._rng), ("_seed", mrandom._seed)):
        monkeypatch.setattr(mrandom, name, value)   # no fake device array outlives the test
    mt.manual_seed(123)
    x0 = np.random.default_rng(0).standard_normal((7, 1001), dtype=np.float32)
    with core_gpu_branch(dropout_cu, mrandom) as log:
        import cupy as cp   # the fake one
        x = cp.asarray(x0)
        for n in range(3):
            y, m = mrandom.dropout_mask(x, 0.4)
            keep = mrandom.dropout_reference(123, n, x.size, 0.4).reshape(x.shape)
            np.testing.assert_array_equal(m, np.where(keep, np.float32(1 / 0.6), np.float32(0)))
            np.testing.assert_array_equal(y, x0 * np.asarray(m))
        assert mrandom.get_state()["gpu_masks_drawn"] == {"0": 3}
    assert [name for name, _, _ in log] == ["minitorch_dropout_philox", "minitorch_dropout_advance"] * 3
    assert log[1][1:] == (1, 1)


def test_uniform_from_bits_covers_zero_to_below_one():
    u = mrandom.uniform_from_bits(np.array([0, 255, 256, 0xFFFFFFFF], dtype=np.uint32))
    assert u.dtype == np.float32 and u[0] == u[1] == 0 and u[2] == 2.0 ** -24 and u[3] == 1 - 2.0 ** -24


def test_random_state_round_trips_through_json_and_reads_old_checkpoints():
    mt.manual_seed(11)
    state = json.loads(json.dumps(mt.random.get_state()))
    a = mt.random.generator().random(4)
    mt.manual_seed(99)
    mt.random.set_state(state)
    np.testing.assert_array_equal(mt.random.generator().random(4), a)
    assert mrandom._seed == 11
    old = state["numpy"]                          # a checkpoint from before the GPU stream had state
    mt.manual_seed(5)
    mt.random.set_state(old)
    np.testing.assert_array_equal(mt.random.generator().random(4), a)


def test_a_gpu_checkpoint_resumes_where_no_gpu_was_used_yet():
    """set_state() with mask counts for devices this process has not touched (another machine's
    checkpoint, or one read without a usable GPU) touches no CUDA; the counts wait in _pending
    until the device draws its first mask."""
    mt.manual_seed(3)
    state = json.loads(json.dumps(mt.random.get_state()))
    state["gpu_masks_drawn"] = {"5": 17}
    saved = dict(mrandom._gpu_states)
    mrandom._gpu_states.clear()
    try:
        mt.random.set_state(state)
        assert mrandom._pending == {5: 17}
        mt.manual_seed(3)
        assert mrandom._pending == {}
    finally:
        mrandom._gpu_states.update(saved)


def test_a_data_parallel_rank_takes_rank_0s_mask_count_on_its_own_gpu():
    """Rank 0 saves its GPU's count; rank 1, on GPU 1, must continue from it (found on two H200s:
    a --gpus 2 run resumed with rank 1's masks restarted from 0)."""
    state = {"numpy": {}, "seed": 3, "gpu_masks_drawn": {"0": 17}}
    moved = mt.random.on_device(state, 1)
    assert moved["gpu_masks_drawn"] == {"1": 17} and state["gpu_masks_drawn"] == {"0": 17}
    assert mt.random.on_device({**state, "gpu_masks_drawn": {}}, 1)["gpu_masks_drawn"] == {}
    with pytest.raises(ValueError, match="mask counts for 2 GPUs"):
        mt.random.on_device({**state, "gpu_masks_drawn": {"0": 1, "1": 1}}, 1)


def test_the_graph_key_sees_module_settings():
    """Dropout's p is a kernel argument in the graph: changing it must change the key (as must a
    layer's backend, training mode, ...); the weights themselves are not part of it."""
    from minitorch_fft.graphs import _settings
    a, b = mt.Dropout(0.3), mt.Dropout(0.5)
    assert _settings(a) != _settings(b)
    conv = mt.SpatialConvolution(2, 3, 3, backend="gemm")
    before = _settings(conv)
    conv.backend = "fbfft"
    assert _settings(conv) != before
    conv.backend = "gemm"
    conv.eval()
    assert _settings(conv) != before
    conv.train()
    conv.weight.data = conv.weight.data * 2
    assert _settings(conv) == before


def test_gpu_uniform_is_refused():
    with pytest.raises(TypeError, match="dropout_mask"):
        mrandom.uniform((3,), xp=object())


# -- cgemm while capturing: the graph's handle and libcublas's own entry point ---------------

def test_capturing_sends_gemms_to_the_graph_handle(rng, cublas_model, monkeypatch):
    """Inside cgemm.capturing() the GEMM goes to the handle given, with cupy_backends' argument
    order (which the model checks), and CuPy's wrapper (which refuses capture) is not called."""
    def refuse(*args):
        raise AssertionError("CuPy's cuBLAS wrapper called during capture")
    import sys
    monkeypatch.setattr(sys.modules["cupy_backends.cuda.libs.cublas"], "gemmStridedBatchedEx", refuse)
    seen = []

    class Handle:
        ptr = 1234

        @staticmethod
        def gemm(handle, *args):
            seen.append(handle)
            _gemm_strided_batched_ex(handle, *args)
    a, b = rand(rng, (3, 4, 5), np.complex64).view(_Device), rand(rng, (3, 4, 6), np.complex64).view(_Device)
    with cgemm.capturing(Handle):
        got = cgemm.matmul(cublas_model, a, b, op_a="C")
        w = rand(rng, (6, 5), np.float32).view(_Device)
        x = rand(rng, (2, 5), np.float32).view(_Device)
        lin = cgemm.matmul(cublas_model, x, w, op_b="T", strict=True)
    np.testing.assert_allclose(got, np.conj(a).transpose(0, 2, 1) @ b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lin, x @ w.T, rtol=1e-5, atol=1e-5)
    assert seen == [1234, 1234] and getattr(cgemm._capture, "now", None) is None   # restored on this thread


def test_strict_gemms_stay_fp32_in_tf32_mode(rng, cublas_model):
    a, b = rand(rng, (4, 5), np.float32).view(_Device), rand(rng, (5, 3), np.float32).view(_Device)
    CALLS.clear()
    with cgemm.tf32(True):
        cgemm.matmul(cublas_model, a, b, strict=True)
        cgemm.matmul(cublas_model, a, b)
    assert CALLS == [68, 77]                      # CUBLAS_COMPUTE_32F, then ..._FAST_TF32


# -- refusals --------------------------------------------------------------------------------

def test_graphed_step_needs_the_gpu():
    model = mt.Sequential(mt.Linear(4, 3))
    opt = mt.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="needs the model on the GPU"):
        mt.graphs.GraphedStep(model, mt.CrossEntropyCriterion(), opt)


def test_train_refuses_cuda_graph_on_the_cpu():
    from test_train import run_train
    p = run_train("--device", "cpu", "--cuda-graph", "--epochs", "1", check=False)
    assert p.returncode == 2 and "--cuda-graph needs the GPU" in p.stderr and "Traceback" not in p.stderr


# -- on the GPU --------------------------------------------------------------------------------

def _net(backend):
    return mt.Sequential(
        mt.SpatialConvolution(3, 8, 5, padding=2, backend=backend), mt.ReLU(), mt.SpatialMaxPooling(2),
        mt.SpatialConvolution(8, 16, 3, padding=1, backend=backend), mt.ReLU(),
        mt.Flatten(), mt.Dropout(0.3), mt.Linear(16 * 8 * 8, 32), mt.ReLU(), mt.Dropout(0.5),
        mt.Linear(32, 10))


def _batches(n, S=16, seed=0):
    r = np.random.default_rng(seed)
    return [(r.standard_normal((S, 3, 16, 16), dtype=np.float32), r.integers(0, 10, S)) for _ in range(n)]


def _train(backend, batches, graphed, lr_at=None, before=None):
    """Weights after training on `batches`, eagerly or through GraphedStep, from seed 0; lr_at =
    (step, lr) changes the learning rate before that step; before(i, step) runs before step i."""
    import cupy as cp
    mt.manual_seed(0)
    model = _net(backend).to("cuda")
    opt = mt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    crit = mt.CrossEntropyCriterion()
    step = mt.graphs.GraphedStep(model, crit, opt) if graphed else None
    losses = []
    for i, (x, y) in enumerate(batches):
        if lr_at and i == lr_at[0]:
            opt.lr = lr_at[1]
        if before is not None:
            before(i, step)
        if step is not None:
            loss, _ = step(cp.asarray(x), y)
        else:
            from minitorch_fft import backends
            with backends.reuse_spectra():
                loss = crit(model(mt.Tensor(cp.asarray(x))), cp.asarray(y))
                opt.zero_grad()
                loss.backward()
            opt.step()
            loss = loss.data
        losses.append(float(loss))
    return [p.numpy() for p in model.parameters()], losses, step


def _graphed_beside_eager(batches):
    """(eager weights, eager losses, model, optimiser, GraphedStep): the reference of _train's eager
    run on `batches`, and a fresh gemm model from the same seed with a GraphedStep of its own."""
    eager_w, eager_loss, _ = _train("gemm", batches, graphed=False)
    mt.manual_seed(0)
    model = _net("gemm").to("cuda")
    opt = mt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    return eager_w, eager_loss, model, opt, mt.graphs.GraphedStep(model, mt.CrossEntropyCriterion(), opt)


def _assert_trained_as_eager(model, losses, eager_w, eager_loss):
    np.testing.assert_allclose(losses, eager_loss, rtol=1e-5)
    for g, e in zip([p.numpy() for p in model.parameters()], eager_w):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_dropout_matches_the_reference_bit_for_bit():
    import cupy as cp
    mt.manual_seed(123)
    x = cp.asarray(np.random.default_rng(0).standard_normal((7, 1001), dtype=np.float32))
    for n in range(3):
        y, m = mrandom.dropout_mask(x, 0.4)
        keep = mrandom.dropout_reference(123, n, x.size, 0.4).reshape(x.shape)
        np.testing.assert_array_equal(cp.asnumpy(m), np.where(keep, np.float32(1 / 0.6), np.float32(0)))
        np.testing.assert_array_equal(cp.asnumpy(y), cp.asnumpy(x) * cp.asnumpy(m))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "fbfft", "gemm", "cufft"])
def test_graphed_training_equals_eager_training(backend):
    """Six steps through the graph (one eager warm-up, one capture, replays) give the weights and
    losses of the same six steps run eagerly: same kernels, same dropout masks."""
    batches = _batches(6)
    eager_w, eager_loss, _ = _train(backend, batches, graphed=False)
    graph_w, graph_loss, step = _train(backend, batches, graphed=True)
    assert step.captures == 1 and step.calls == 6
    np.testing.assert_allclose(graph_loss, eager_loss, rtol=1e-5)
    for g, e in zip(graph_w, eager_w):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    assert len(set(np.round(graph_loss, 6))) == 6


@pytest.mark.gpu
def test_replays_draw_new_dropout_masks():
    import cupy as cp
    batches = _batches(4)
    _, _, step = _train("gemm", batches, graphed=True)
    drawn = int(mrandom._gpu_states[cp.cuda.Device().id][1])
    assert drawn == 2 * 4              # two Dropout layers, four steps: the replays advanced the counter


@pytest.mark.gpu
def test_a_new_learning_rate_is_captured_again():
    batches = _batches(5)
    eager_w, _, _ = _train("auto", batches, graphed=False, lr_at=(3, 0.01))
    graph_w, _, step = _train("auto", batches, graphed=True, lr_at=(3, 0.01))
    assert step.captures == 2
    for g, e in zip(graph_w, eager_w):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_a_new_dropout_rate_runs_one_eager_step_then_captures_again():
    import cupy as cp
    batches = _batches(5)
    mt.manual_seed(0)
    model = _net("auto").to("cuda")
    opt = mt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = mt.graphs.GraphedStep(model, mt.CrossEntropyCriterion(), opt)
    for i, (x, y) in enumerate(batches):
        if i == 3:
            model[6].p = 0.1
        step(cp.asarray(x), y)
    assert step.captures == 2 and step.calls == 5     # eager, capture, replay, eager, capture


@pytest.mark.gpu
def test_host_targets_with_gpu_logits_are_checked_on_the_host_and_give_the_same_loss():
    """train.py's eager step hands the loader's NumPy targets over as they are: their range is
    checked on the host (no device sync), then they are copied; the loss is the device targets'."""
    import cupy as cp
    x = mt.Tensor(cp.asarray(np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)))
    y = np.array([1, 2, 3, 9])
    crit = mt.CrossEntropyCriterion()
    assert crit(x, y).item() == crit(x, cp.asarray(y)).item() == crit(x, y.tolist()).item()
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 10\), got values in \[1, 10\]"):
        crit(x, np.array([1, 2, 3, 10]))


def test_a_loss_checks_targets_through_the_bounds_queued_for_them_and_no_others(monkeypatch):
    """Inside functional.targets_ahead(b), a loss on b.target asks b for the range check (the
    reductions train_step queued before the forward); a loss on any other targets runs
    check_target_range as before, and outside the block b is never asked."""
    import minitorch_fft.functional as F
    asked, ranged = [], []

    class Bounds:
        def __init__(self, target):
            self.target = target

        def check(self, n_classes):
            asked.append(n_classes)
            raise ValueError("from the bounds")

        def settle(self):
            pass

    monkeypatch.setattr(F, "check_target_range", lambda t, n: ranged.append(n))
    x = mt.Tensor(np.zeros((4, 10), np.float32))
    y, other = np.array([1, 2, 3, 4]), np.array([0, 0, 0, 0])
    with F.targets_ahead(Bounds(y)):
        with pytest.raises(ValueError, match="from the bounds"):
            mt.CrossEntropyCriterion()(x, y)
        assert asked == [10] and ranged == []
        mt.CrossEntropyCriterion()(x, other)
        assert ranged == [10]
    mt.CrossEntropyCriterion()(x, y)
    assert asked == [10] and ranged == [10, 10]


def test_bounds_never_read_are_settled_when_the_block_ends():
    """A step that raises before its loss leaves its TargetBounds unread: targets_ahead's exit
    settles it (waits for its copy into pinned memory), whether the block ends normally or raises."""
    import minitorch_fft.functional as F
    settled = []

    class Bounds:
        target = None

        def settle(self):
            settled.append(True)

    with F.targets_ahead(Bounds()):
        pass
    with pytest.raises(RuntimeError, match="forward failed"):
        with F.targets_ahead(Bounds()):
            raise RuntimeError("forward failed")
    assert settled == [True, True]


def test_a_failing_settle_never_hides_the_blocks_own_error():
    """After a sticky CUDA error the bounds' wait raises again at the block's exit: the caller sees
    the block's error (its type intact), and a settle that fails after a clean block still raises."""
    import minitorch_fft.functional as F

    class Bounds:
        target = None

        def settle(self):
            raise RuntimeError("sticky error, again")

    with pytest.raises(MemoryError, match="the block's own"):
        with F.targets_ahead(Bounds()):
            raise MemoryError("the block's own")
    with pytest.raises(RuntimeError, match="sticky error, again"):
        with F.targets_ahead(Bounds()):
            pass
    assert F._targets_ahead is None


def test_host_targets_queue_no_bounds():
    """Only 1-D integer CuPy targets get reductions queued ahead; host targets, Tensors, lists and
    float arrays go to the loss's own check (and its errors) unchanged."""
    import minitorch_fft.functional as F
    for target in (np.array([1, 2]), [1, 2], np.array([1.0, 2.0]), mt.Tensor(np.zeros(2, np.float32))):
        assert F.target_bounds(target) is None


@pytest.mark.gpu
def test_device_targets_in_a_step_are_checked_without_waiting_for_the_forward(monkeypatch):
    """train_step with targets on the GPU: their range comes from two reductions queued before the
    forward (functional.TargetBounds), never from check_target_range at the loss, which would wait
    for the whole forward pass. The step equals one with host targets; targets out of range are
    refused, naming the range and the values, before backward or the update changes a parameter
    (the forward has run by then, as before: dropout's stream and batch norms' statistics moved)."""
    import cupy as cp
    import minitorch_fft.functional as F
    x, y = _batches(1)[0]
    results = []
    for on_device in (False, True):
        mt.manual_seed(0)
        model = _net("gemm").to("cuda")
        opt = mt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        crit = mt.CrossEntropyCriterion()
        if on_device:
            monkeypatch.setattr(F, "check_target_range", lambda t, n: pytest.fail("waited for the forward"))
        loss, _ = mt.train_step(model, crit, opt, mt.Tensor(cp.asarray(x)), cp.asarray(y) if on_device else y)
        results.append((loss.item(), [p.data.get() for p in model.parameters()]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_array_equal(a, b)
    kept = [p.data.copy() for p in model.parameters()]
    for bad in (np.where(np.arange(16) == 3, 10, y), np.where(np.arange(16) == 5, -2, y)):
        with pytest.raises(ValueError, match=rf"targets must lie in \[0, 10\), got values in "
                                             rf"\[{bad.min()}, {bad.max()}\]"):
            mt.train_step(model, crit, opt, mt.Tensor(cp.asarray(x)), cp.asarray(bad))
        for before, p in zip(kept, model.parameters()):
            assert cp.array_equal(before, p.data)


@pytest.mark.gpu
def test_bad_batches_are_refused_before_the_replay():
    import cupy as cp
    batches = _batches(2)
    _, _, step = _train("gemm", batches, graphed=True)
    x, y = batches[0]
    with pytest.raises(ValueError, match="the graph was made for x"):
        step(cp.asarray(x[:8]), y[:8])
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 10\), got values in \[0, 10\]"):
        step(cp.asarray(x), np.where(np.arange(16) == 3, 10, y))
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 10\)"):
        step(cp.asarray(x), cp.asarray(np.where(np.arange(16) == 3, -1, y)))
    with pytest.raises(TypeError, match="integer class indices"):
        step(cp.asarray(x), y.astype(np.float32))


@pytest.mark.gpu
def test_memory_the_graph_uses_is_not_handed_out_after_cufft_lets_it_go():
    """cufft's scratch buffers and plans are in the graph; after release_buffers() (or a buffer
    that grows, or a plan evicted from the cache) new arrays must not land in that memory, or the
    next replay would overwrite them."""
    import cupy as cp

    from minitorch_fft import backends
    batches = _batches(3)
    _, _, step = _train("cufft", batches, graphed=True)
    sizes = [b.nbytes for b in backends.cufft.held_on_device() if hasattr(b, "nbytes")]
    assert step.captures == 1 and sizes
    backends.cufft.release_buffers()
    junk = [cp.full(n // 4, 7.0, np.float32) for n in sizes for _ in range(2)]
    x, y = batches[0]
    step(cp.asarray(x), y)
    cp.cuda.Device().synchronize()
    assert all(bool((j == 7.0).all()) for j in junk)


def test_the_graph_holds_cudnns_built_plans(monkeypatch):
    """held_on_device(), what a captured graph keeps alive, lists cudnn's built plans beside cufft's
    buffers: an out-of-memory fallback drops both caches (backends._release), and a graph replays
    the plans it captured."""
    from minitorch_fft import backends
    plan = object()
    monkeypatch.setitem(backends.cudnn._built, ("a key",), plan)
    assert any(h is plan for h in backends.held_on_device())
    backends.cudnn.release_buffers()
    assert not any(h is plan for h in backends.held_on_device())


@pytest.mark.gpu
def test_a_graphed_step_keeps_its_cudnn_plans_when_the_cache_drops_them():
    """cudnn's built plans, captured in a step, live as long as the graph: dropped from the cache
    (as an out-of-memory fallback drops them) they are still alive, and the replays train as the
    eager steps do."""
    import gc
    import weakref

    from minitorch_fft import backends
    from conftest import backend_usable
    if not backend_usable("cudnn"):
        pytest.skip("cuDNN not usable here")
    batches, refs = _batches(5), []

    def drop(i, step):
        if step is not None and i == 3:            # captured at step 1, replayed at 2
            refs.extend(weakref.ref(p) for p in backends.cudnn.built_plans())
            backends._release(backends.cudnn)      # what run_pass's out-of-memory fallback does
            gc.collect()

    eager_w, eager_loss, _ = _train("cudnn", batches, graphed=False)
    graph_w, graph_loss, step = _train("cudnn", batches, graphed=True, before=drop)
    assert step.captures == 1 and refs and all(r() is not None for r in refs)
    # (a plan that splits its reduction sums in another order from run to run: not bit for bit)
    np.testing.assert_allclose(graph_loss, eager_loss, rtol=1e-4)
    for g, e in zip(graph_w, eager_w):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


class _Residual(mt.Module):
    """conv-bn-relu and a shortcut: batch norm's buffers inside a captured step."""

    def __init__(self):
        self.conv = mt.SpatialConvolution(3, 3, 3, padding=1, bias=False, backend="gemm")
        self.bn = mt.SpatialBatchNormalization(3)
        self.relu = mt.ReLU()
        self.pool = mt.SpatialAdaptiveAveragePooling(1)
        self.flatten = mt.View(3)
        self.fc = mt.Linear(3, 10)

    def forward(self, x):
        return self.fc(self.flatten(self.pool(self.relu(self.bn(self.conv(x)) + x))))


def _train_bn(batches, graphed, reload_at=None):
    import cupy as cp
    mt.manual_seed(0)
    model = _Residual().to("cuda")
    opt = mt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = mt.CrossEntropyCriterion()
    step = mt.graphs.GraphedStep(model, crit, opt) if graphed else None
    for i, (x, y) in enumerate(batches):
        if i == reload_at:    # new parameter and buffer arrays: the graph must be captured again
            model.load_state_dict(model.state_dict())
        if step is not None:
            step(cp.asarray(x), y)
        else:
            mt.train_step(model, crit, opt, mt.Tensor(cp.asarray(x)), cp.asarray(y))
    return model.state_dict(), step


@pytest.mark.gpu
@pytest.mark.parametrize("reload_at", [None, 3])
def test_graphed_batch_norm_updates_its_running_statistics_at_every_replay(reload_at):
    """Six graphed steps leave the weights, running statistics and batch count of six eager steps:
    the replays update the buffers in place, and a load_state_dict (new buffer arrays) captures
    again rather than replaying into the old ones."""
    batches = _batches(6)
    eager, _ = _train_bn(batches, graphed=False, reload_at=reload_at)
    graphed, step = _train_bn(batches, graphed=True, reload_at=reload_at)
    assert step.captures == (1 if reload_at is None else 2)
    assert int(graphed["bn.num_batches_tracked"]) == 6
    for k, v in eager.items():
        np.testing.assert_allclose(graphed[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


# -- the capture's planned arena (graphs.plan_arena, _Planned) ------------------------------------

def _overlap(a, b):
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.parametrize("seed", range(6))
def test_planned_blocks_alive_together_never_share_a_byte(seed):
    r = np.random.default_rng(seed)
    blocks = []
    for t in range(60):
        start = int(r.integers(0, 200))
        end = None if r.random() < 0.1 else start + int(r.integers(1, 40))
        blocks.append((int(r.integers(1, 5000)), start, end))
    offsets, size = mt.graphs.plan_arena(blocks, align=512)
    spans = [(s, np.inf if e is None else e) for _, s, e in blocks]
    places = [(o, o + -(-n // 512) * 512) for o, (n, _, _) in zip(offsets, blocks)]
    assert all(o % 512 == 0 for o in offsets) and max(hi for _, hi in places) == size
    for i in range(len(blocks)):
        for j in range(i):
            if _overlap(spans[i], spans[j]):
                assert not _overlap(places[i], places[j]), (blocks[i], blocks[j])
    # never less than the most bytes alive at one moment, and not far above it on these cases
    # (a planner that shared nothing would take every byte: several times more)
    live = max(sum(hi - lo for (lo, hi), (a, b) in zip(places, spans) if a <= t < b) for t in range(-1, 240))
    assert live <= size <= 1.25 * live, (size, live, sum(hi - lo for lo, hi in places))


def test_the_plan_is_the_smallest_of_its_orders():
    r = np.random.default_rng(7)
    blocks = [(int(r.integers(1, 5000)), int(s), None if r.random() < 0.1 else int(s) + int(r.integers(1, 40)))
              for s in r.integers(0, 200, 80)]
    _, size = mt.graphs.plan_arena(blocks, align=512)
    sizes = np.array([-(-b[0] // 512) * 512 for b in blocks])
    start = np.array([b[1] for b in blocks], dtype=float)
    end = np.array([np.inf if b[2] is None else b[2] for b in blocks], dtype=float)
    largest_first = mt.graphs._first_fit(sizes, start, end, np.lexsort((start, -sizes)))[1]
    in_request_order = mt.graphs._first_fit(sizes, start, end, np.argsort(start, kind="stable"))[1]
    assert size <= min(largest_first, in_request_order)


def _trace(name):
    data = json.loads((pathlib.Path(__file__).parent / "data" / "alexnet_b128_planned_blocks.json").read_text())
    return data["blocks"][name]


@pytest.mark.parametrize("name", ["alexnet strict", "alexnet TF32 mode"])
def test_a_real_steps_plan_comes_within_a_percent_of_the_most_alive_at_once(name):
    # AlexNet's blocks as a capture on an H100 asked for them: first fit in the best of the four
    # orders stays 2-4 % over the most bytes alive at once (strict: 820.5 MiB against 789.4), the search
    # closes that; the plan never overlaps two blocks alive together, and the same blocks give
    # the same plan
    blocks = _trace(name)
    offsets, size = mt.graphs.plan_arena(blocks)
    sizes = np.array([-(-n // 512) * 512 for n, _, _ in blocks], dtype=np.int64)
    start = np.array([a for _, a, _ in blocks], dtype=float)
    end = np.array([np.inf if b is None else b for _, _, b in blocks], dtype=float)
    floor = mt.graphs._most_alive(sizes, start, end)
    first_fits = [mt.graphs._first_fit(sizes, start, end, o)[1]
                  for o in (np.lexsort((start, -sizes)), np.argsort(start, kind="stable"))]
    assert floor <= size <= 1.01 * floor < min(first_fits), (size, floor, first_fits)
    alive = max(sum(int(z) for z, a, b in zip(sizes, start, end) if a <= t < b) for t in range(int(start.max()) + 1))
    assert alive == floor
    for i in range(len(blocks)):
        for j in range(i):
            if start[i] < end[j] and start[j] < end[i]:
                assert offsets[i] + sizes[i] <= offsets[j] or offsets[j] + sizes[j] <= offsets[i]
    assert mt.graphs.plan_arena(blocks) == (offsets, size)


def test_the_search_stops_at_the_most_alive_at_once():
    # one block after another, none alive together: every order is already at the floor
    blocks = [(4096, t, t + 1) for t in range(50)]
    calls = []
    first_fit = mt.graphs._first_fit

    def counted(*args):
        calls.append(1)
        return first_fit(*args)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(mt.graphs, "_first_fit", counted)
        assert mt.graphs.plan_arena(blocks, align=512)[1] == 4096
    assert len(calls) == 4        # the four orders, no search


def test_no_search_past_plan_many_blocks(monkeypatch):
    blocks = _trace("alexnet strict")          # 131 blocks, over its bound after the four orders
    calls = []
    first_fit = mt.graphs._first_fit
    monkeypatch.setattr(mt.graphs, "_first_fit", lambda *a: calls.append(1) or first_fit(*a))
    searched = mt.graphs.plan_arena(blocks)
    assert len(calls) > 4
    calls.clear()
    monkeypatch.setattr(mt.graphs, "PLAN_MANY", len(blocks) - 1)
    alone = mt.graphs.plan_arena(blocks)
    assert len(calls) == 4 and searched[1] < alone[1]


def test_a_plan_of_nested_lifetimes_takes_the_most_bytes_alive_at_once():
    # a step's typical shape: activations kept for the backward, scratch freed at once
    blocks = [(4096, 0, 9), (1024, 1, 2), (2048, 3, 8), (1024, 4, 5), (512, 6, 7), (512, 8, None)]
    offsets, size = mt.graphs.plan_arena(blocks, align=512)
    assert size == 4096 + 2048 + 1024           # the widest moment (t=4)
    # the block kept after the capture (a gradient) takes bytes a block let go before it started
    assert offsets[5] in (offsets[2], offsets[3], offsets[4])


class _FakeCuda:
    """What _Planned needs of cupy.cuda, on the host: memory that notes its owner's release."""
    class UnownedMemory:
        def __init__(self, ptr, size, owner, device_id):
            self.ptr, self.size, self.owner = ptr, size, owner

    class MemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr = mem, mem.ptr + offset


class _FakeCp:
    cuda = _FakeCuda


class _Arena:
    ptr, device_id = 1 << 20, 0


def _replay(planned, script):
    """Run `script` (("a", size) allocates, ("f", k) frees the k-th allocation) on `planned`."""
    held = []
    for op, v in script:
        if op == "a":
            held.append(planned.malloc(v))
        else:
            held[v] = None
    return held


def test_a_second_capture_that_matches_the_first_gets_the_plan():
    script = [("a", 1000), ("a", 600), ("f", 1), ("a", 600), ("f", 0)]
    blocks = [[1024, 0, 4], [1024, 1, 2], [1024, 3, None]]
    offsets, _ = mt.graphs.plan_arena(blocks)
    fallback = []
    planned = mt.graphs._Planned(_FakeCp, _Arena, blocks, offsets, lambda n: fallback.append(n))
    held = _replay(planned, script)
    assert planned.matched() and fallback == []
    assert [h.ptr - _Arena.ptr for h in held if h is not None] == [offsets[2]]


@pytest.mark.parametrize("script, planned_blocks", [
    ([("a", 1000), ("a", 2000), ("f", 1), ("a", 600), ("f", 0)], 1),     # another size
    ([("a", 1000), ("a", 600), ("a", 600), ("f", 1), ("f", 0)], 2),      # a block let go later
    ([("a", 1000), ("a", 600), ("f", 1), ("f", 0)], 2),                  # a block fewer
])
def test_a_second_capture_that_goes_another_way_leaves_the_plan_at_once(script, planned_blocks):
    """The third request of the second script has the planned size but comes while block 1, which
    the plan let go before it, is still alive: it must not get the place block 1 shares with it."""
    blocks = [[1024, 0, 4], [1024, 1, 2], [1024, 3, 5]]
    offsets, _ = mt.graphs.plan_arena(blocks)
    assert offsets[1] == offsets[2]                  # the plan lets them share
    fallback = []
    planned = mt.graphs._Planned(_FakeCp, _Arena, blocks, offsets, lambda n: fallback.append(n))
    _replay(planned, script)
    assert not planned.matched() and len(planned.seen) == planned_blocks


def test_what_a_second_capture_asks_for_leaves_out_the_caches_and_keeps_the_end():
    # after the graph is dropped (from t=7 on), block 2 is still held by a cache and block 4 by a
    # parameter (its gradient, made again by the next capture); block 3 went first with the graph
    blocks = [[1024, 0, 5], [512, 1, 2], [512, 3, None], [2048, 4, 7], [512, 6, None]]
    cached = [False, False, True, False, False]
    assert mt.graphs._expected(blocks, 7, cached) == [[1024, 0, 4], [512, 1, 2], [2048, 3, None],
                                                      [512, 5, None]]


def test_a_capture_thrown_away_gives_the_momentum_buffers_back():
    """A momentum buffer the thrown-away capture made was never initialised: the next capture must
    make it again (and initialise it), not read it."""
    class Pool:
        freed = 0

        def free_all_blocks(self):
            self.freed += 1
    step = object.__new__(mt.graphs.GraphedStep)         # its CPU-side state only
    step.optimizer = mt.optim.SGD([mt.Parameter(np.zeros(3, np.float32))], lr=0.1, momentum=0.9)
    step.pool, step.graph, step.loss, step.logits, step._held = Pool(), object(), 1, 2, [3]
    before = list(step.optimizer.velocity)
    step.optimizer.velocity[0] = np.full(3, np.nan, np.float32)   # made in the capture, never written
    step._drop_graph(before)
    assert step.optimizer.velocity == [None] and step.graph is None and step._held == []
    assert step.pool.freed == 1


def test_the_caches_pointers_are_their_arrays_and_plans_work_areas():
    class Mem:
        def __init__(self, ptr):
            self.ptr = ptr

    class Ptr:
        def __init__(self, ptr):
            self.mem = Mem(ptr)

    class Array:
        data = Ptr(4096)

    class Plan:
        work_area = Ptr(8192)

    class PlanWithoutWorkArea:
        work_area = None
    assert mt.graphs._pointers([Array(), Plan(), PlanWithoutWorkArea()]) == {4096, 8192}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gemm", "auto"])
def test_a_step_captured_into_its_planned_arena_trains_as_eager(backend, monkeypatch):
    """With the plan taken whatever it saves (ARENA_GAIN), the second capture runs from the arena,
    and six steps (one eager, two captures, replays) give eager training's weights and losses."""
    monkeypatch.setattr(mt.graphs, "ARENA_GAIN", float("inf"))
    batches = _batches(6, S=64)
    eager_w, eager_loss, _ = _train(backend, batches, graphed=False)
    graph_w, graph_loss, step = _train(backend, batches, graphed=True)
    size, grown = step.arena_plan
    assert step._arena is not None and step.records == 2 and step.captures == 1, (size, grown, step.plan_miss)
    np.testing.assert_allclose(graph_loss, eager_loss, rtol=1e-5)
    for g, e in zip(graph_w, eager_w):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_a_capture_with_no_room_for_its_arena_falls_back_to_the_pool(monkeypatch):
    """An arena that cannot be allocated leaves the plan, not the step: the graph is captured from
    the pool (a third record) and trains as eager."""
    import cupy as cp
    monkeypatch.setattr(mt.graphs, "ARENA_GAIN", float("inf"))
    seen = {}

    class Pool(cp.cuda.MemoryPool):     # GraphedStep's pool, refusing the arena's one allocation
        def malloc(self, size):
            if size == seen.get("arena"):
                seen["arena"] = None          # once: the pool's own requests go through after it
                raise cp.cuda.memory.OutOfMemoryError(size, 0, 0)
            return super().malloc(size)

    plan = mt.graphs.plan_arena

    def plan_and_note(blocks, align=mt.graphs.ALIGN):
        offsets, size = plan(blocks, align)
        seen["arena"] = size
        return offsets, size
    monkeypatch.setattr(mt.graphs, "plan_arena", plan_and_note)
    monkeypatch.setattr(cp.cuda, "MemoryPool", Pool)
    batches = _batches(6, S=64)
    eager_w, eager_loss, _ = _train("gemm", batches, graphed=False)
    graph_w, graph_loss, step = _train("gemm", batches, graphed=True)
    assert step._arena is None and step.records == 2 and "arena" in step.plan_miss
    np.testing.assert_allclose(graph_loss, eager_loss, rtol=1e-5)
    for g, e in zip(graph_w, eager_w):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_a_released_graph_gives_its_memory_back_and_captures_again():
    """release() empties the graph's pool (only blocks the backends' caches keep may stay), and the
    steps after it (one eager, then a new capture) train as eager."""
    import cupy as cp
    batches = _batches(6, S=64)
    eager_w, eager_loss, model, opt, step = _graphed_beside_eager(batches)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == 3:
            held = step.pool.total_bytes()
            step.release()
            assert step.graph is None and step.pool.total_bytes() < held
            assert all(p.grad is None for p in opt.params)
        losses.append(float(step(cp.asarray(x), y)[0]))
    assert step.captures == 2
    _assert_trained_as_eager(model, losses, eager_w, eager_loss)


@pytest.mark.gpu
def test_a_buffer_refilled_in_place_is_read_where_it_is_and_another_array_switches_to_a_copy():
    """A caller that refills one device array passes the very array of the warm-up step at the
    capture: the graph reads it in place (no copy), sees each refill, and trains as eager; a call
    with another array switches to a buffer of the graph's own, and the training stays eager's."""
    import cupy as cp
    batches = _batches(6, S=64)
    eager_w, eager_loss, model, _, step = _graphed_beside_eager(batches)
    buf = cp.empty(batches[0][0].shape, np.float32)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i < 4:
            buf[...] = cp.asarray(x)
            losses.append(float(step(buf, y)[0]))
            if i == 1:
                assert step.borrowed and step.x is buf
        else:
            losses.append(float(step(cp.asarray(x), y)[0]))
            assert not step.borrowed and step.x is not buf
    np.testing.assert_array_equal(buf.get(), batches[3][0])       # never written by the graph
    assert step._last_x is None
    _assert_trained_as_eager(model, losses, eager_w, eager_loss)


@pytest.mark.gpu
def test_a_new_array_each_call_goes_through_the_static_buffer():
    """Arrays made afresh each call (the pool may hand back one address) are copied, never borrowed."""
    batches = _batches(4, S=16)
    _, _, step = _train("gemm", batches, graphed=True)
    assert not step.borrowed and step.captures == 1


@pytest.mark.gpu
def test_a_released_graph_lets_go_of_the_array_it_read_in_place():
    """release() on a graph reading the caller's array in place drops it; the next calls (an eager
    step, a capture) with the same array borrow it again and train as eager."""
    import cupy as cp
    batches = _batches(6, S=64)
    eager_w, eager_loss, model, _, step = _graphed_beside_eager(batches)
    buf = cp.empty(batches[0][0].shape, np.float32)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == 3:
            assert step.borrowed
            step.release()
            assert not step.borrowed and step.x is None and step._last_x is None
        buf[...] = cp.asarray(x)
        losses.append(float(step(buf, y)[0]))
    assert step.borrowed and step.x is buf and step.captures == 2
    _assert_trained_as_eager(model, losses, eager_w, eager_loss)

"""The autograd engine against central finite differences (float32 ops, float64 differences)."""
import numpy as np
import pytest

from minitorch_fft import backends
import minitorch_fft as mt
import minitorch_fft.functional as F


def numeric_grad(f, arrays, i, eps=1e-2):
    """d sum(f * probe) / d arrays[i], central differences, one element at a time."""
    a = arrays[i]
    grad = np.zeros(a.shape, np.float64)
    for idx in np.ndindex(a.shape):
        orig = a[idx]
        a[idx] = orig + eps
        hi = f(*arrays)
        a[idx] = orig - eps
        lo = f(*arrays)
        a[idx] = orig
        grad[idx] = (hi - lo) / (2 * eps)
    return grad


OPS = {  # name -> (function of Tensors returning a scalar Tensor, input shapes)
    "conv2d": (lambda x, w: F.conv2d(x, w, stride=(2, 1), padding=(1, 0)), [(2, 2, 5, 4), (3, 2, 3, 2)]),
    "linear": (lambda x, w, b: F.linear(x, w, b), [(3, 4), (2, 4), (2,)]),
    "relu": (F.relu, [(3, 5)]),
    "max_pool2d": (lambda x: F.max_pool2d(x, 3, 2), [(1, 2, 7, 7)]),
    "log_softmax": (F.log_softmax, [(3, 4)]),
    "reshape": (lambda x: F.reshape(x, (6, 2)), [(3, 4)]),
    "mul": (lambda a, b: a * b, [(3, 2), (3, 2)]),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_gradients_match_finite_differences(name):
    rng = np.random.default_rng(7)
    fn, shapes = OPS[name]
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    probe = rng.standard_normal(fn(*[mt.Tensor(a) for a in arrays]).shape).astype(np.float32)
    if name == "relu":  # keep away from the kink, where differences are meaningless
        arrays[0][np.abs(arrays[0]) < 0.05] = 0.5

    def scalar(*arrs):
        return float((fn(*[mt.Tensor(a) for a in arrs]).data.astype(np.float64) * probe).sum())

    ts = [mt.Tensor(a, requires_grad=True) for a in arrays]
    (fn(*ts) * mt.Tensor(probe)).sum().backward()
    for i, t in enumerate(ts):
        num = numeric_grad(scalar, [a.astype(np.float64).astype(np.float32) for a in arrays], i)
        np.testing.assert_allclose(t.grad, num, rtol=2e-3, atol=2e-3, err_msg=f"{name} input {i}")


def test_cross_entropy_gradient():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    y = np.array([0, 3, 4, 1])
    t = mt.Tensor(x, requires_grad=True)
    F.cross_entropy(t, y).backward()
    num = numeric_grad(lambda a: float(F.cross_entropy(mt.Tensor(a), y).data), [x.copy()], 0, eps=1e-3)
    np.testing.assert_allclose(t.grad, num, rtol=1e-2, atol=1e-3)


def test_gradients_accumulate_and_no_grad():
    w = mt.Tensor(np.ones((2, 2)), requires_grad=True)
    x = mt.Tensor(np.full((2, 2), 3.0))
    (w * x).sum().backward()
    (w * x).sum().backward()
    assert np.array_equal(w.grad, np.full((2, 2), 6.0, np.float32))
    with mt.no_grad():
        y = w * x
    assert not y.requires_grad and y._ctx is None
    assert mt.is_grad_enabled()


def test_shared_subexpression_gradient():
    a = mt.Tensor(np.array([2.0, -1.0]), requires_grad=True)
    b = a * a
    (b * b + b).sum().backward()  # d/da (a^4 + a^2) = 4a^3 + 2a
    np.testing.assert_allclose(a.grad, 4 * a.data ** 3 + 2 * a.data)


def test_first_layer_skips_bprop(monkeypatch):
    """No gradInput for an input that does not require grad: bprop is never called."""
    calls = []
    monkeypatch.setattr(backends.gemm, "bprop", lambda *a, **k: calls.append(1))
    conv = mt.SpatialConvolution(2, 3, 3)
    conv(mt.Tensor(np.random.default_rng(0).standard_normal((1, 2, 5, 5)))).sum().backward()
    assert calls == [] and conv.weight.grad is not None and conv.bias.grad is not None


def test_tensor_dtype_policy():
    assert mt.Tensor(np.arange(4, dtype=np.float64)).data.dtype == np.float32
    assert mt.Tensor(np.arange(4, dtype=np.int64)).data.dtype == np.float32
    with pytest.raises(TypeError, match="real numbers"):
        mt.Tensor(np.array(["a"]))


def test_numbers_on_either_side_of_add_and_mul():
    """(2 t + 1) * 3 = 6 t + 3, so dy/dt = 6 everywhere; a NumPy float32 counts as a number
    (as the optimiser accepts np.float32 learning rates)."""
    t = mt.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3), requires_grad=True)
    y = (2.0 * t + 1) * np.float32(3)
    np.testing.assert_array_equal(y.data, 6 * np.arange(6, dtype=np.float32).reshape(2, 3) + 3)
    assert y.data.dtype == np.float32
    y.sum().backward()
    np.testing.assert_array_equal(t.grad, np.full((2, 3), 6, np.float32))
    assert mt.optim.SGD([mt.Parameter(np.ones(2))], lr=np.float32(0.1)).lr == pytest.approx(0.1)


def test_backward_takes_a_number_or_a_list_of_the_tensors_shape():
    t = mt.Tensor(np.ones(3, np.float32), requires_grad=True)
    (t * t).sum().backward(1.0)
    np.testing.assert_array_equal(t.grad, [2, 2, 2])
    u = mt.Tensor(np.ones(3, np.float32), requires_grad=True)
    (u * 2.0).backward([1.0, 2.0, 3.0])
    np.testing.assert_array_equal(u.grad, [2, 4, 6])
    assert u.grad.dtype == np.float32


def test_a_second_backward_through_a_freed_graph_raises_as_in_pytorch():
    """backward() twice silently doubled the gradients. As in PyTorch, the first backward frees
    what the graph saved and the second raises RuntimeError (before any gradient changes);
    retain_graph=True keeps the graph, and then both accumulate, as PyTorch's do."""
    import torch
    tw = torch.ones(2, requires_grad=True)
    ty = (tw * tw).sum()
    ty.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        ty.backward()
    w = mt.Tensor(np.ones(2), requires_grad=True)
    y = (w * w).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time.*retain_graph=True"):
        y.backward()
    np.testing.assert_array_equal(w.grad, tw.grad.numpy())               # [2, 2], not doubled

    tz = (tw * tw).sum()
    tz.backward(retain_graph=True)
    tz.backward()
    z = (w * w).sum()
    z.backward(retain_graph=True)
    z.backward()
    np.testing.assert_array_equal(w.grad, tw.grad.numpy())               # [6, 6] in both


def test_backward_through_part_of_a_freed_graph_raises():
    """A new tensor built on an intermediate of a graph already backpropagated: the old part's
    saved values are gone, so PyTorch refuses, and so do we; gradients stay as they were."""
    import torch
    ta = torch.tensor([2.0, -1.0], requires_grad=True)
    tb = ta * ta
    tb.sum().backward()
    with pytest.raises(RuntimeError):
        (tb * 3.0).sum().backward()
    a = mt.Tensor(np.array([2.0, -1.0]), requires_grad=True)
    b = a * a
    b.sum().backward()
    with pytest.raises(RuntimeError, match="Mul saved"):
        (b * 3.0).sum().backward()
    np.testing.assert_array_equal(a.grad, ta.grad.numpy())


def test_backward_frees_the_saved_arrays():
    """The freed graph holds no saved arrays (memory back before the next forward)."""
    conv = mt.SpatialConvolution(1, 2, 3)
    y = conv(mt.Tensor(np.ones((1, 1, 5, 5)), requires_grad=True)).sum()
    ctx = y._ctx.parents[0]           # the graph links Functions: the conv that made Sum's input
    assert hasattr(ctx, "x")
    y.backward()
    assert ctx.freed and not hasattr(ctx, "x") and not hasattr(ctx, "w")


def test_an_output_no_function_saved_is_freed_once_dropped_as_in_pytorch():
    """The graph links Functions, not the Tensors between them: a convolution's output, which
    the ReLU after it did not save, is freed as soon as the caller drops it, as PyTorch frees it
    (before, the ReLU's graph link held it, and every such output, until the graph was dropped)."""
    import gc
    import weakref

    import torch
    rng = np.random.default_rng(0)
    x_np, w_np = rng.standard_normal((2, 1, 6, 6)), rng.standard_normal((3, 1, 3, 3))
    tx, tw = torch.tensor(x_np, requires_grad=True), torch.tensor(w_np, requires_grad=True)
    ty = torch.nn.functional.conv2d(tx, tw)
    t_alive = weakref.ref(ty)
    tz = torch.relu(ty).sum()
    del ty
    x, w = mt.Tensor(x_np, requires_grad=True), mt.Parameter(w_np)
    y = F.conv2d(x, w, backend="gemm")
    alive = weakref.ref(y.data)
    z = F.relu(y).sum()
    del y
    gc.collect()
    assert t_alive() is None and alive() is None
    tz.backward()
    z.backward()                                 # the gradients do not need it either
    np.testing.assert_allclose(x.grad, tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w.grad, tw.grad.numpy(), rtol=1e-5, atol=1e-5)


class _Watch(mt.tensor.Function):
    """The identity; its backward records which of `later` (Functions backward runs before this
    one) have freed what they saved by then."""

    def forward(self, x, later, seen):
        self.later, self.seen = later, seen
        return x

    def backward(self, g):
        self.seen.extend(f.freed for f in self.later)
        return g


@pytest.mark.parametrize("retain_graph", [False, True])
def test_each_function_frees_what_it_saved_right_after_its_own_backward(retain_graph):
    """Saved arrays go as backward passes each Function, as PyTorch frees each node's saved
    tensors after that node's backward: while backward reaches the first layer, the later
    layers' saved arrays are gone already (not all at the end of backward). retain_graph=True
    keeps them all."""
    later, seen = [], []
    x = mt.Tensor(np.random.default_rng(1).standard_normal((2, 1, 6, 6)), requires_grad=True)
    conv = mt.SpatialConvolution(1, 3, 3, backend="gemm")
    h = _Watch.apply(conv(x), later=later, seen=seen)
    r = F.relu(h)
    s = F.relu(r * 2.0)
    later += [r._ctx, s._ctx]                          # ReLUFn, ReLUFn: saved masks
    first = h._ctx.parents[0]                          # the convolution, still to run backward
    s.sum().backward(retain_graph=retain_graph)
    assert seen == [not retain_graph] * 2
    assert first.freed is not retain_graph and hasattr(first, "x") is retain_graph


@pytest.mark.gpu
def test_the_pool_takes_an_unsaved_output_back_on_the_gpu():
    """On the GPU the convolution's output goes back to CuPy's pool when the caller drops it:
    the pool's used bytes fall by its size (rounded to the pool's 512-byte unit)."""
    import cupy as cp
    pool = cp.get_default_memory_pool()
    x = mt.Tensor(cp.random.standard_normal((4, 2, 16, 16), dtype=np.float32), requires_grad=True)
    w = mt.Parameter(cp.random.standard_normal((8, 2, 3, 3), dtype=np.float32))
    y = F.conv2d(x, w, backend="gemm")
    z = F.relu(y).sum()
    nbytes = -(-y.data.nbytes // 512) * 512
    cp.cuda.Device().synchronize()
    before = pool.used_bytes()
    del y
    assert before - pool.used_bytes() == nbytes
    z.backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape

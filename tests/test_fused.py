"""The fused layer kernels (minitorch_fft/fused.py, kernels/fused.cu) against PyTorch in float64:
ReLU and the residual add + ReLU, a convolution's bias and its gradient, batch normalisation in
training and evaluation (forward, gradients, running statistics) on odd shapes, and a batch-norm
training step captured as a CUDA graph. The add + ReLU layer runs on the CPU too."""
import copy
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import minitorch_fft as mt
from conftest import DEVICES
from minitorch_fft import functional as F
from reference import rel_error


def _grads(fn, ref_fn, inputs, device, rng, upstream=None):
    """fn on float32 Tensors against ref_fn on float64 torch tensors, under one random upstream
    gradient (or `upstream`): (output, reference output, [(gradient, reference gradient)] per
    input)."""
    ts = [mt.Tensor(mt.to_device(a, device), requires_grad=True) for a in inputs]
    out = fn(*ts)
    tt = [torch.tensor(a.astype(np.float64), requires_grad=True) for a in inputs]
    ref = ref_fn(*tt)
    g = rng.standard_normal(ref.shape).astype(np.float32) if upstream is None else upstream
    (out * mt.Tensor(mt.to_device(g, device))).sum().backward()
    ref.backward(torch.tensor(g.astype(np.float64)))
    return out.numpy(), ref.detach().numpy(), [(t.grad, r.grad.numpy()) for t, r in zip(ts, tt)]


# Sizes around the 32-value mask words and the 256-thread blocks.
RELU_SHAPES = [(1,), (31,), (33,), (3, 5, 7, 9), (2, 3, 129, 131)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", RELU_SHAPES)
def test_add_relu_against_torch(device, shape, rng):
    a, b = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    out, ref, grads = _grads(F.add_relu, lambda s, t: TF.relu(s + t), [a, b], device, rng)
    assert rel_error(out, ref) <= 1e-6
    for got, want in grads:
        assert rel_error(got, want) <= 1e-6


def test_add_relu_refuses_other_shapes():
    with pytest.raises(ValueError, match="shapes differ"):
        F.add_relu(mt.Tensor(np.zeros((2, 3), np.float32)), mt.Tensor(np.zeros((3, 2), np.float32)))
    with pytest.raises(TypeError, match="two Tensors"):
        F.add_relu(mt.Tensor(np.zeros(2, np.float32)), 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", RELU_SHAPES)
def test_relu_kernel_mask_and_gradient(shape, rng):
    """One bit per value, set where x > 0; NaN propagates forward and gets no gradient (Torch's
    threshold_backward); values exactly 0 stay 0."""
    import cupy as cp
    from minitorch_fft import fused
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[::7] = 0
    flat[3::11] = np.nan
    y, mask = fused.relu(cp.asarray(x))
    ref = TF.relu(torch.tensor(x.astype(np.float64))).numpy()
    np.testing.assert_array_equal(np.isnan(cp.asnumpy(y)), np.isnan(ref))
    np.testing.assert_array_equal(np.nan_to_num(cp.asnumpy(y)), np.nan_to_num(ref).astype(np.float32))
    bits = np.unpackbits(cp.asnumpy(mask).view(np.uint8), bitorder="little")[:x.size]
    np.testing.assert_array_equal(bits.astype(bool), (flat > 0))
    g = rng.standard_normal(shape).astype(np.float32)
    gx = cp.asnumpy(fused.relu_backward(cp.asarray(g), mask))
    np.testing.assert_array_equal(gx, np.where(x > 0, g, np.float32(0)))
    # and through the layer, against torch's gradient where it is defined
    _, _, [(got, want)] = _grads(mt.ReLU(), TF.relu, [np.nan_to_num(x) + 0.5], "cuda", rng)
    assert rel_error(got, want) <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(5, 1, 1, 1), (3, 5, 7, 9), (2, 3, 129, 131), (64, 2048, 7, 7)])
def test_bias_add_and_gradient_kernels(shape, rng):
    """The per-plane add and the per-channel sum (many blocks per channel for the large planes,
    one value per plane for 1x1) against float64."""
    import cupy as cp
    from minitorch_fft import fused
    y = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(shape[1]).astype(np.float32)
    out = cp.asnumpy(fused.bias_add(cp.asarray(y), cp.asarray(b)))
    assert rel_error(out, y.astype(np.float64) + b.astype(np.float64).reshape(1, -1, 1, 1)) <= 1e-7
    g = (rng.standard_normal(shape) + 3).astype(np.float32)   # a mean: the sums do not cancel
    gb = cp.asnumpy(fused.bias_grad(cp.asarray(g)))
    assert rel_error(gb, g.astype(np.float64).sum(axis=(0, 2, 3))) <= 1e-6


@pytest.mark.gpu
def test_conv_bias_gradient_through_the_layer(rng):
    """The bias's passes do not depend on the backend: gemm's (auto would tune first)."""
    layer = mt.SpatialConvolution(3, 7, 3, padding=1, backend="gemm").to("cuda")
    w, b = (torch.tensor(p.numpy().astype(np.float64), requires_grad=True) for p in (layer.weight, layer.bias))
    x = rng.standard_normal((5, 3, 23, 17)).astype(np.float32)
    out, ref, _ = _grads(layer, lambda t: TF.conv2d(t, w, b, padding=1), [x], "cuda", rng)
    assert rel_error(out, ref) <= 1e-5
    assert rel_error(layer.bias.grad, b.grad.numpy()) <= 1e-5
    assert rel_error(layer.weight.grad, w.grad.numpy()) <= 1e-5


BN_SHAPES = [(3, 5, 7, 9), (2, 64, 1, 1), (64, 32, 7, 7), (8, 4, 112, 112)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", BN_SHAPES)
@pytest.mark.parametrize("affine,momentum", [(True, 0.1), (False, 0.3), (True, None)])
def test_batch_norm_kernels_against_torch(shape, affine, momentum, rng):
    """Three training steps then two in evaluation, inputs far from zero mean (30 +- 2: the
    statistics must not cancel): outputs, every gradient, the running statistics and the batch
    count against torch.nn.BatchNorm2d in float64."""
    planes = shape[1]
    layer = mt.SpatialBatchNormalization(planes, momentum=momentum, affine=affine)
    if affine:
        layer.weight.data = rng.uniform(0.5, 1.5, planes).astype(np.float32)
        layer.bias.data = rng.standard_normal(planes).astype(np.float32)
    layer.running_var.data = rng.uniform(0.5, 2, planes).astype(np.float32)
    ref = torch.nn.BatchNorm2d(planes, affine=affine, momentum=momentum).double()
    with torch.no_grad():
        for k, v in layer.state_dict().items():
            getattr(ref, k).copy_(torch.tensor(v))
    layer.to("cuda")
    for training in (True, True, True, False, False):
        layer.train(training), ref.train(training)
        x = (rng.standard_normal(shape) * 2 + 30).astype(np.float32)
        g = rng.standard_normal(shape).astype(np.float32)
        layer.zero_grad()
        ref.zero_grad()
        torch32 = copy.deepcopy(ref).float()     # PyTorch's own fp32 layer in the same state
        out, out_ref, [(gx, gx_ref)] = _grads(layer, ref, [x], "cuda", rng, upstream=g)
        x32 = torch.tensor(x, requires_grad=True)
        y32 = torch32(x32)
        y32.backward(torch.tensor(g))
        assert rel_error(out, out_ref) <= max(1e-5, 4 * rel_error(y32.detach().numpy(), out_ref))
        # dx cancels (with two values a plane it is all rounding, found on an H100: 4.3e-3), so
        # the bound is PyTorch fp32's own error on the same data, or 1e-4 where that is smaller
        assert rel_error(gx, gx_ref) <= max(1e-4, 4 * rel_error(x32.grad.numpy(), gx_ref))
        if affine:
            for ours, want, fp32 in ((layer.weight, ref.weight, torch32.weight), (layer.bias, ref.bias, torch32.bias)):
                assert rel_error(ours.grad, want.grad.numpy()) <= max(1e-5, 4 * rel_error(fp32.grad.numpy(),
                                                                                        want.grad.numpy()))
        state = layer.state_dict()
        for k in ("running_mean", "running_var"):
            assert rel_error(state[k], getattr(ref, k).numpy()) <= 1e-6, k
        assert int(state["num_batches_tracked"]) == int(ref.num_batches_tracked)


@pytest.mark.gpu
def test_batch_norm_with_batch_statistics_only(rng):
    """F.batch_norm in training without running statistics (torch's running_mean=None)."""
    x = (rng.standard_normal((4, 3, 5, 5)) - 7).astype(np.float32)
    w, b = rng.uniform(0.5, 1.5, 3), rng.standard_normal(3)
    wt, bt = (mt.Parameter(mt.to_device(v.astype(np.float32), "cuda")) for v in (w, b))
    wr, br = torch.tensor(w, requires_grad=True), torch.tensor(b, requires_grad=True)
    out, ref, [(gx, gx_ref)] = _grads(lambda t: F.batch_norm(t, None, None, wt, bt, training=True),
                                      lambda t: TF.batch_norm(t, None, None, wr, br, training=True),
                                      [x], "cuda", rng)
    assert rel_error(out, ref) <= 1e-5 and rel_error(gx, gx_ref) <= 1e-4
    assert rel_error(wt.grad, wr.grad.numpy()) <= 1e-5 and rel_error(bt.grad, br.grad.numpy()) <= 1e-5


@pytest.mark.gpu
def test_graphed_batch_norm_step_moves_the_running_statistics_as_torch(rng):
    """A training step through BatchNorm (cumulative average: its momentum 1/n is computed on the
    device) captured as a CUDA graph: after one eager step and five replays, the running
    statistics and batch count are torch's over the same six batches, and the weights those of
    the same six steps run eagerly."""
    import cupy as cp
    batches = [((rng.standard_normal((16, 3, 6, 6)) * 3 + 5).astype(np.float32), rng.integers(0, 4, 16))
               for _ in range(6)]

    def train(graphed):
        mt.manual_seed(0)
        model = mt.Sequential(mt.SpatialBatchNormalization(3, momentum=None), mt.ReLU(), mt.Flatten(),
                              mt.Linear(3 * 6 * 6, 4)).to("cuda")
        opt = mt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        crit = mt.CrossEntropyCriterion()
        step = mt.graphs.GraphedStep(model, crit, opt) if graphed else None
        for x, y in batches:
            if graphed:
                step(cp.asarray(x), y)
            else:
                mt.train_step(model, crit, opt, mt.Tensor(cp.asarray(x)), cp.asarray(y))
        return model.state_dict(), step

    graphed, step = train(True)
    eager, _ = train(False)
    assert step.captures == 1 and step.calls == 6
    ref = torch.nn.BatchNorm2d(3, momentum=None).double().train()
    for x, _ in batches:
        ref(torch.tensor(x.astype(np.float64)))
    assert int(graphed["0.num_batches_tracked"]) == 6
    for k in ("running_mean", "running_var"):
        assert rel_error(graphed[f"0.{k}"], getattr(ref, k).numpy()) <= 1e-6, k
    for k, v in eager.items():
        np.testing.assert_allclose(graphed[k], v, rtol=1e-5, atol=1e-6, err_msg=k)

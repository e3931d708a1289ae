"""SGD with momentum and weight decay against torch.optim.SGD (float64), on every device; on the
GPU the update is one fused kernel per parameter (optim._sgd_kernel, kernels/sgd.cu), which the
CPU also runs compiled for the host against step()'s NumPy update."""
import ctypes

import numpy as np
import pytest
import torch

import minitorch_fft as mt
from conftest import DEVICES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("momentum,weight_decay", [(0.9, 0.0), (0.9, 5e-4), (0.0, 1e-3)])
def test_sgd_matches_torch_over_several_steps(device, momentum, weight_decay, rng):
    shapes = [(4, 3, 3, 3), (4,), (7, 5)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(4)]
    params = [mt.Tensor(mt.to_device(a, device), requires_grad=True) for a in init]
    opt = mt.optim.SGD(params, lr=0.05, momentum=momentum, weight_decay=weight_decay)
    ref = [torch.tensor(a.astype(np.float64), requires_grad=True) for a in init]
    topt = torch.optim.SGD(ref, lr=0.05, momentum=momentum, weight_decay=weight_decay)
    for step in grads:
        for p, r, g in zip(params, ref, step):
            p.grad = mt.to_device(g, device)
            r.grad = torch.tensor(g.astype(np.float64))
        opt.step()
        topt.step()
    for p, r in zip(params, ref):
        np.testing.assert_allclose(mt.to_device(p.data, "cpu"), r.detach().numpy(), rtol=1e-5, atol=1e-6)


# -- kernels/sgd.cu on the host, against step()'s NumPy update -----------------------------------
SGD_WRAPPER = r"""
extern "C" void emu_sgd(const float* g, float lr, float momentum, float wd, int first, float* p,
                        float* v, long long size, unsigned grid, unsigned block) {
    launch(grid, block, [=] { minitorch_sgd_momentum(g, lr, momentum, wd, first, p, v, size); });
}
"""


@pytest.fixture(scope="module")
def sgd_cu(tmp_path_factory):
    from test_cuda_compile import core_host_library
    return core_host_library(tmp_path_factory, "sgd.cu", SGD_WRAPPER)


@pytest.mark.parametrize("weight_decay", [0.0, 5e-4])
def test_sgd_kernel_on_the_host_equals_the_numpy_step(sgd_cu, weight_decay, rng):
    """The fused GPU update (optim.SGD._fused_step's kernel) does step()'s arithmetic in step()'s
    order: bit for bit the same parameters and velocity over three steps, the first included."""
    shape, lr, momentum = (5, 67), 0.05, 0.9
    p0 = rng.standard_normal(shape).astype(np.float32)
    param = mt.Tensor(p0.copy(), requires_grad=True)
    opt = mt.optim.SGD([param], lr=lr, momentum=momentum, weight_decay=weight_decay)
    p, v = p0.copy(), np.full(shape, np.nan, np.float32)   # v as _fused_step allocates it: empty
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)     # noqa: E731
    for step in range(3):
        g = rng.standard_normal(shape).astype(np.float32)
        param.grad = g
        opt.step()
        sgd_cu.emu_sgd(ptr(g), ctypes.c_float(lr), ctypes.c_float(momentum), ctypes.c_float(weight_decay),
                       int(step == 0), ptr(p), ptr(v), ctypes.c_longlong(p.size), 3, 32)  # grid-stride
        np.testing.assert_array_equal(p, param.data)
        np.testing.assert_array_equal(v, opt.velocity[0])

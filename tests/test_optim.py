"""SGD with momentum and weight decay against torch.optim.SGD (float64), on every device; on the
GPU the update is one fused kernel per parameter (optim._sgd_kernel, kernels/sgd.cu), which the
CPU also runs compiled for the host against step()'s NumPy update."""
import ctypes

import numpy as np
import pytest
import torch

import minitorch_fft as mt
from conftest import DEVICES
from minitorch_fft import optim
from test_cuda_compile import core_gpu_branch, core_host_library


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
@pytest.fixture(scope="module")
def sgd_cu(tmp_path_factory):
    return core_host_library(tmp_path_factory, "sgd.cu")


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


@pytest.mark.parametrize("momentum,weight_decay", [(0.9, 0.0), (0.9, 5e-4), (0.0, 1e-3)])
def test_gpu_step_run_on_the_host_equals_the_cpu_step(sgd_cu, momentum, weight_decay, rng):
    """SGD.step()'s GPU branch on a fake CuPy (test_cuda_compile.core_gpu_branch): with momentum one
    fused launch per parameter, its arguments of the kernel's C types, the same result bit for bit."""
    shapes = [(4, 3, 3, 3), (4,), (300, 7)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    cpu = [mt.Tensor(a.copy(), requires_grad=True) for a in init]
    cpu_opt = mt.optim.SGD(cpu, lr=0.05, momentum=momentum, weight_decay=weight_decay)
    with core_gpu_branch(sgd_cu, optim) as log:
        import cupy as cp   # the fake one
        gpu = [mt.Tensor(a, requires_grad=True) for a in init]
        for t in gpu:
            t.data = cp.asarray(t.data)
        gpu_opt = mt.optim.SGD(gpu, lr=0.05, momentum=momentum, weight_decay=weight_decay)
        for step in grads:
            for pc, pg, g in zip(cpu, gpu, step):
                pc.grad, pg.grad = g, cp.asarray(g)
            cpu_opt.step()
            gpu_opt.step()
    for pc, pg in zip(cpu, gpu):
        np.testing.assert_array_equal(np.asarray(pg.data), pc.data)
    if momentum:
        assert [name for name, _, _ in log] == ["minitorch_sgd_momentum"] * 9
        assert max(grid for _, grid, _ in log) == (300 * 7 + 255) // 256
    else:
        assert log == []   # plain SGD stays four array operations


@pytest.mark.parametrize("device", DEVICES)
def test_a_gradient_of_another_shape_is_refused_not_broadcast(device):
    """A .grad set by hand to another shape: numpy broadcast it into every weight on the CPU (the GPU's fused
    kernel refused it); both refuse it now, the weights untouched."""
    p = mt.nn.SpatialConvolution(2, 2, 3).to(device).weight
    before = p.numpy().copy()
    p.grad = p.xp.ones((1,), np.float32)
    for momentum in (0.0, 0.9):
        with pytest.raises(ValueError, match=r"parameter 0 has a gradient of shape \(1,\) for its shape \(2, 2, 3, 3\)"):
            optim.SGD([p], lr=0.1, momentum=momentum).step()
    assert np.array_equal(p.numpy(), before)

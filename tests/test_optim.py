"""SGD with momentum and weight decay against torch.optim.SGD (float64), on every device; on the
GPU the update is one fused kernel per parameter (optim._sgd_kernel)."""
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

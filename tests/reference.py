"""The independent reference: PyTorch's conv2d and its gradients in float64.

Never compare a backend with itself or with another backend of this project.
"""
import numpy as np
import torch
import torch.nn.functional as TF

from minitorch_fft.device import to_device


def conv_reference(x, w, gy, stride, padding):
    """(y, gx, gw) of Torch's cross-correlation, computed in float64 on the CPU."""
    xt = torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=True)
    wt = torch.tensor(np.asarray(w, dtype=np.float64), requires_grad=True)
    y = TF.conv2d(xt, wt, stride=stride, padding=padding)
    y.backward(torch.tensor(np.asarray(gy, dtype=np.float64)))
    return y.detach().numpy(), xt.grad.numpy(), wt.grad.numpy()


def rel_error(got, ref):
    """||got - ref|| / ||ref|| in float64 (0 if both are zero). NaN never passes."""
    got = np.asarray(to_device(got, "cpu"), dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"shape {got.shape} != reference {ref.shape}"
    assert np.all(np.isfinite(got)), "non-finite values in the result"
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / den) if den else float(np.linalg.norm(got))


def check_backend(backend, x, w, stride, padding, device="cpu", tol=1e-5, rng=None):
    """Run all three passes of `backend` and compare each with the float64 reference."""
    rng = rng or np.random.default_rng(0)
    S, f, h, wd = x.shape
    fo, _, kh, kw = w.shape
    oh = (h + 2 * padding[0] - kh) // stride[0] + 1
    ow = (wd + 2 * padding[1] - kw) // stride[1] + 1
    gy = rng.standard_normal((S, fo, oh, ow)).astype(np.float32)
    y_ref, gx_ref, gw_ref = conv_reference(x, w, gy, stride, padding)
    xd, wd_, gyd = (to_device(a, device) for a in (x, w, gy))
    errs = {
        "fprop": rel_error(backend.fprop(xd, wd_, stride=stride, padding=padding), y_ref),
        "bprop": rel_error(backend.bprop(gyd, wd_, x.shape, stride=stride, padding=padding), gx_ref),
        "accgrad": rel_error(backend.accgrad(gyd, xd, w.shape, stride=stride, padding=padding), gw_ref),
    }
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"relative error above {tol}: {bad} (x {x.shape}, w {w.shape}, stride {stride}, pad {padding})"
    return errs

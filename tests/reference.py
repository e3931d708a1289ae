"""The independent reference: PyTorch's conv2d and its gradients in float64.

Never compare a backend with itself or with another backend of this project.
"""
import numpy as np
import torch
import torch.nn.functional as TF

from benchmarks.harness import flip_report, kinked_modules, replay_branch
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
    assert np.all(np.isfinite(ref)), "non-finite values in the reference"   # else every error is NaN
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


class Kinks:
    """A network's branch at its kinks, taken from one run and replayed in another.

    A ReLU's gradient switches where its input crosses 0, a max-pool's where two inputs of a window
    tie. An input within rounding of a kink may fall on either side in fp32 and in float64, and
    then the two gradients differ by a whole term: a converted ResNet-18 whose every conv pass is
    within 3e-6 of float64 had gradients 0.5-1.5 % from it (benchmarks/NOTES.md, session 19). A
    gradient check is about the convolutions, so the references follow the tested net's branch:

        kinks = Kinks()
        kinks.record(ours)                    # forward hooks; then run ours
        kinks.replay(reference, tol=1e-4)     # then run the reference; it takes ours' branch
        kinks.report()                        # where the two branches differ, and by how much

    record(): each ReLU call's mask (output > 0) and each MaxPool2d call's argmax, in call order
    per module (torchvision's blocks call one ReLU twice). replay(): the reference's ReLUs return
    input * mask (made out of place, so its hooks see the input) and its max-pools gather the
    recorded argmax. Each replayed call also measures its own branch against the recorded one: a
    ReLU input on the other side of 0, or a window whose own maximum is above the recorded one, is
    a flip, with size |input| (or the gap) over the RMS of the call's input. Flips larger than
    `tol` are a forward error, not rounding, and report() lists them in `too_large`."""

    def __init__(self):
        self.recorded, self.flips, self.too_large, self._handles = {}, [], [], []

    def record(self, model):
        for name, m in kinked_modules(model):
            self.recorded[name] = []

            def hook(m, inp, out, calls=self.recorded[name]):
                if isinstance(m, torch.nn.ReLU):
                    calls.append(out.detach() > 0)
                else:
                    calls.append(TF.max_pool2d(inp[0].detach(), m.kernel_size, m.stride, m.padding, m.dilation,
                                               ceil_mode=m.ceil_mode, return_indices=True)[1])
            self._handles.append(m.register_forward_hook(hook))

    def replay(self, model, tol=1e-4):
        """From now on `model`'s forward takes the recorded branch (one forward per record)."""
        calls = {}
        for name, _ in kinked_modules(model):
            if name not in self.recorded:
                raise ValueError(f"Kinks.replay: {name} was not recorded (another architecture?)")
            calls[name] = iter(self.recorded[name])

        def take(name, m):
            try:
                return next(calls[name])
            except StopIteration:
                raise ValueError(f"Kinks.replay: {name} is called more often than it was recorded "
                                 f"({len(self.recorded[name])} calls; one forward per record)") from None
        self._handles += replay_branch(model, take, self.flips, self.too_large, tol)

    def report(self):
        """One line: how many kinks the two runs took differently, and the largest (relative)."""
        return flip_report(self.flips)

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []

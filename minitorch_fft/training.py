"""One training step, written once: forward, loss, backward, optimiser update.

train.py, GraphedStep (the step it captures) and the benchmarks all run this function, so the
three cannot drift apart. Forward and backward run inside backends.reuse_spectra() (unless
reuse_spectra=False): the FFT backends compute each spectrum once per step and share it across
a layer's passes. The optimiser's update comes after that block, because it changes the weights
in place and a spectrum of the old weights must not outlive them.
"""
import contextlib

from . import backends

from . import functional as F


def train_step(model, criterion, optimizer, x, y, reuse_spectra=True, sync=None):
    """Run one step on batch x (a Tensor) with targets y; returns (loss, logits) as Tensors.
    sync: a distributed.GradientSync (data-parallel): gradients are averaged over the ranks as
    backward produces them, and the average is complete before the update.

    Nothing here waits for this step's GPU work: reading loss.item() or the logits is the caller's
    sync point. Targets on the GPU have their range checked at the loss through two reductions
    queued before the forward pass, so that check waits for what was queued before this step
    (functional.TargetBounds); host targets are checked on the host."""
    scope = backends.reuse_spectra() if reuse_spectra else contextlib.nullcontext()
    with scope, F.targets_ahead(F.target_bounds(y)):
        logits = model(x)
        loss = criterion(logits, y)
        optimizer.zero_grad()
        if sync is not None:
            sync.begin()
        loss.backward()
    if sync is not None:
        sync.finish()
    optimizer.step()
    return loss, logits

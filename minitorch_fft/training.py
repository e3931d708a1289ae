"""One training step, written once: forward, loss, backward, optimiser update.

train.py, GraphedStep (the step it captures) and the benchmarks all run this function, so the
three cannot drift apart. Forward and backward run inside backends.reuse_spectra() (unless
reuse_spectra=False): the FFT backends compute each spectrum once per step and share it across
a layer's passes. The optimiser's update comes after that block, because it changes the weights
in place and a spectrum of the old weights must not outlive them.
"""
import contextlib

import numpy as np

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


def saved_bytes_per_image(model, input_shape, device="cpu"):
    """Bytes that a training step of `model` (on the host) on `device` ("cpu" or "cuda") keeps for its
    backward pass for each image of a batch: the arrays its forward saves (each layer's input, masks, ...),
    each counted once however many layers hold it, parameters and buffers not counted. Found by forward
    passes of one image and of two on the host (zeros of `input_shape`, (C, H, W)) with gradients
    recorded: the difference is what one more image adds. Every convolution runs on `gemm` for them (the
    saved arrays are a layer's input and weight whatever its backend; auto would time the two tiny
    batches), in evaluation mode (no dropout draw, no running statistic moved): nothing of the model
    changes. A ReLU's mask is a byte a value on the host, a bit on the GPU (fused.relu): counted so.

    A lower bound of what an image costs a step: backward's gradients and a backend's scratch (spectra,
    columns) come on top, and training mode saves dropout's masks and more of batch normalisation."""
    from . import nn
    from .tensor import Function, Tensor, _topological_order, enable_grad
    params = {id(_base(p.data)) for p in model.parameters()} | {id(_base(b.data)) for b in model.buffers()}
    convs = [m for m in model.modules() if isinstance(m, nn.SpatialConvolution)]
    chosen, modes = [m.backend for m in convs], [(m, m.training) for m in model.modules()]

    def nbytes(a):
        return (a.size + 7) // 8 if device == "cuda" and a.dtype == np.bool_ else a.nbytes

    def saved(images):
        out = model(Tensor(np.zeros((images, *input_shape), np.float32)))
        arrays = {}
        for node in _topological_order(out._ctx if out._ctx is not None else out):
            if isinstance(node, Function):
                for name, value in vars(node).items():
                    for a in value if isinstance(value, (tuple, list)) else (value,):
                        if isinstance(a, np.ndarray) and name not in Function._GRAPH:
                            arrays.setdefault(id(_base(a)), nbytes(_base(a)))
        return sum(n for key, n in arrays.items() if key not in params)

    try:
        for m in convs:
            m.backend = "gemm"
        model.eval()
        with enable_grad():
            return max(0, saved(2) - saved(1))
    finally:
        for m, backend in zip(convs, chosen):
            m.backend = backend
        for m, training in modes:    # each as it was (a frozen batch norm stays in evaluation)
            m.training = training


def _base(a):
    """The array that owns a's memory (a itself unless a is a view)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a

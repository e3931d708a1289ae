"""Spectra shared across the passes of one training step, for both FFT backends (cufft, fbfft).

Within one step a layer's three passes transform the same arrays:

  fprop    FFT(x)   FFT(w)
  bprop    FFT(gy)  FFT(w)      <- fprop's
  accGrad  FFT(gy)  FFT(x)      <- bprop's, fprop's

Inside `with backends.reuse_spectra():` each is computed once, so 6 forward FFTs per layer and
step become 3 (4 by default in layers: the weight's is not kept, below). Layers need no change;
the training loop wraps one step, forward and backward (train.py does by default;
--no-reuse-spectra turns it off):

    with backends.reuse_spectra():
        loss = criterion(model(x), y)
        loss.backward()
    optimizer.step()              # after the block: it changes the weights in place

A spectrum is found again by the identity of the array it was computed from and by a Key: the
backend (cufft and fbfft lay spectra out differently, and cufft scales the weight's), the role
(x, w, gy), the basis, and the offset at which the array sits in the basis (fbfft places x at
(ph, pw); cufft shifts w by (-ph, -pw)). Passes that differ in any of these compute their own:
under `auto` a layer's passes share spectra only where consecutive passes run on the same FFT
backend and basis (a tuned cufft pass may pick its own basis).

Hazards:
- Arrays must not be modified in place inside the block: the key is the object, not its values.
  The framework's own in-place update, SGD.step(), drops the block's spectra first, so a step
  taken inside the block (gradient accumulation, several steps per block) is safe.
- Only whole-batch spectra are shared; a pass that splits its batch into chunks computes each
  chunk's spectrum and keeps none.
- A spectrum is handed out once more, then dropped: in a step each has one later consumer (w in
  bprop, x in accGrad, gy in the second of the backward passes: accGrad in the framework's
  layers, bprop in the PyTorch adapter's), and dropping it there keeps alive only the spectra
  still to come.
- A spectrum nobody will ask for is not kept at all. backends.run_pass says, through keeping(),
  which roles a pass may keep: fprop x and w, bprop gy, each only where the layer's later pass
  that would take it runs (its input wants a gradient) and runs on the same backend (under auto
  it may run elsewhere); accGrad gy only where its caller runs bprop after it (the PyTorch
  adapter does), else nothing. A layer's weight spectrum is kept only where the
  reuse_weight_spectra setting asks (off by default: memory, see backends._kept_roles); then
  bprop computes its own, and a step saves 2 forward FFTs per layer instead of 3. Backend
  functions called directly (not through run_pass) keep every spectrum, as before.
- A spectrum kept for a pass that then runs elsewhere (under auto, a consumer not tuned yet counts
  as the same backend) or in another basis is never asked for. A gy spectrum is dropped after the
  layer's last pass of the step (backends.run_pass): gy is the layer's own, and nothing later
  takes it. Left to the end of the block it held memory through the rest of the backward, and
  under torch.compile's reduce-overhead, whose cudagraph trees run each graph of the backward
  from a pool of their own, it was a live allocation in that pool that no graph returned: the
  trees refused the step ("tensor(s) in the cudagraph pool not tracked as outputs"; converted
  AlexNet's first step in TF32 mode, benchmarks/NOTES.md, session 55).
- Memory: between a layer's forward and its backward, its x spectrum stays alive (unless the
  block was opened with inputs=False), and its w spectrum where kept. A weight spectrum is the
  large one: n*(m//2+1) complex64 values per kh x kw float32 kernel.
- Tuners time candidates with sharing suspended(), so each candidate pays for its own FFTs.
"""
import contextlib
from collections import namedtuple

from .utils import OpenBlocks

# backend "cufft" | "fbfft", role "x" | "w" | "gy", basis (n, m), offset (rows, cols) in the basis
Key = namedtuple("Key", "backend role basis offset")


class StepCache:
    """The spectra of one reuse_spectra() block, keyed by (Key, id(array)), with hit counts.
    inputs False: fprop keeps no input (x) spectrum (reuse_spectra's docstring)."""

    def __init__(self, inputs=True):
        self.inputs = inputs
        self._entries = {}
        self.hits = self.misses = 0
        self.hit_keys = []            # the Key of every hit, in order (what was reused, and where)

    def get(self, key, owner, compute):
        """compute()'s spectrum of `owner` under `key`: computed and kept, or handed out and dropped."""
        entry = self._entries.pop((key, id(owner)), None)
        if entry is not None:
            self.hits += 1
            self.hit_keys.append(key)
            return entry[1]
        self.misses += 1
        spectrum = compute()
        keep = _keep   # read once: another thread's pass may change it
        if keep is None or key.role in keep:
            self._entries[(key, id(owner))] = (owner, spectrum)   # holding owner keeps its id unique
        return spectrum

    def discard(self, owner, role):
        """Drop what is kept of `owner` under `role`, asked for or not: a spectrum kept for a pass
        that then ran elsewhere or in another basis (backends.run_pass, after a layer's last pass)."""
        ident = id(owner)
        for k in [k for k in self._entries if k[1] == ident and k[0].role == role]:
            del self._entries[k]

    def clear(self):
        """Drop every kept spectrum (the counts stay)."""
        self._entries.clear()

    def __len__(self):
        return len(self._entries)


_active = None   # the last open block if a StepCache (reuse_spectra's), else None (suspended(), or none open)
_keep = None     # the roles a miss may keep (the last open keeping() block's); None: every role


def _set_active(block):
    global _active
    _active = block if isinstance(block, StepCache) else None


def _set_keep(entry):
    global _keep
    _keep = None if entry is None else entry[1]


# The open blocks in the order they opened: reuse_spectra()'s StepCaches and suspended()'s markers;
# keeping()'s (marker, roles). Each leaves wherever it is (utils.OpenBlocks: the state is the
# process's, since a CUDA backward runs on PyTorch's thread, and two threads' blocks may end out of order).
_open = OpenBlocks(_set_active)
_keeps = OpenBlocks(_set_keep)


@contextlib.contextmanager
def reuse_spectra(inputs=True):
    """Within the block, FFT passes share the spectra of the same x, w and gy objects (module
    docstring). Yields the block's StepCache (hits, misses); its spectra are dropped on exit.

    inputs=False: no spectrum lives from forward to backward, where a step's memory peaks (every
    layer's activations are alive then): fprop keeps no x spectrum, and accGrad transforms x again;
    bprop's gy spectrum still serves accGrad, inside the backward pass. (A step saves 1 forward
    FFT per layer instead of 2, for the memory of one layer's gy spectrum at a time.)"""
    with _open.open(StepCache(inputs)) as cache:
        try:
            yield cache
        finally:
            cache.clear()


@contextlib.contextmanager
def suspended():
    """No sharing inside the block (tuners: every timed candidate must pay for its FFTs)."""
    with _open.open(object()):
        yield


@contextlib.contextmanager
def keeping(roles):
    """Inside the block, a spectrum computed afresh is kept only if its Key's role is in `roles`
    (None: every role): the pass knows which of its spectra a later pass will ask for."""
    with _keeps.open((object(), None if roles is None else frozenset(roles))):
        yield


def active():
    """The current block's StepCache, or None outside reuse_spectra() (or while suspended)."""
    return _active


def drop():
    """Free the current block's spectra (the out-of-memory fallback); later passes recompute."""
    active = _active   # read once: another thread's block may end meanwhile
    if active is not None:
        active.clear()


def shared(key, owner, compute, *args):
    """compute(*args), or the spectrum already computed from `owner` under `key` in this block.

    owner None: a chunk of the batch, never shared.
    """
    active = _active   # read once: another thread's block may end meanwhile
    if active is None or owner is None:
        return compute(*args)
    return active.get(key, owner, lambda: compute(*args))

"""A stand-in for CuPy under the backends' GPU code, for CPU tests of their prepared calls: NumPy
allocations, and every FFT launch, GEMM and kernel launch recorded (kernel, sizes, offsets, operand
shapes, GEMM flags, integer arguments), and every spectrum asked of reuse.shared (its key and its
owner: a name given with watch(), else "made" and its shape), nothing computed. The prepared call and the pass function,
run on the same stand-in, must record the same list. install() puts it under fbfft, polyphase and
tiledfft; winograd's test puts its pieces in place itself."""
import functools

import numpy as np

from minitorch_fft.backends import cgemm, fbfft, fbfft_kernels, polyphase, tiledfft


def _plain(args):
    return tuple(("array", a.shape) if isinstance(a, np.ndarray) else float(a) if isinstance(a, (float, np.floating))
                 else int(a) for a in args)


def _product_shape(a_shape, b_shape, op_a, op_b):
    p = a_shape[-2] if op_a == "N" else a_shape[-1]
    q = b_shape[-1] if op_b == "N" else b_shape[-2]
    return tuple(a_shape[:-2]) + (p, q)


class Recorder:
    """Install with install(monkeypatch); calls holds what was launched, in order."""

    __name__ = "recorder"

    def __init__(self):
        self.calls = []
        self.watched = {}

    def watch(self, **arrays):
        """Name these arrays in the record of reuse.shared's owners (any other owner is recorded as an
        array the pass made, by its shape: a new object each call)."""
        self.watched.update((id(a), name) for name, a in arrays.items())

    @staticmethod
    def empty(shape, dtype):
        return np.empty(shape, dtype)

    def install(self, monkeypatch):
        """fbfft's, polyphase's and tiledfft's GPU code on this stand-in: their array checks answer it,
        the FFT launchers, cgemm's matmul and prepare, and polyphase's and tiledfft's kernels record."""
        check = lambda **arrays: (self, *arrays.values())  # noqa: E731
        for module in (fbfft, polyphase, tiledfft):
            monkeypatch.setattr(module, "check_arrays", check)
        for module in (fbfft, polyphase):      # each spectrum asked for: its key and owner, before it is made
            monkeypatch.setattr(module, "shared", self._shared(module.shared))
        monkeypatch.setattr(fbfft, "_PAIRS", {})
        monkeypatch.setattr(fbfft_kernels, "rfft2_launcher", self._launcher("rfft2"))
        monkeypatch.setattr(fbfft_kernels, "irfft2_launcher", self._launcher("irfft2"))
        monkeypatch.setattr(cgemm, "matmul", self.matmul)
        monkeypatch.setattr(cgemm, "prepare", self.prepare_gemm)
        # caches of the test's own: the modules' keep no kernel or launcher of the stand-in's
        for module, cached in ((polyphase, "_launcher"), (tiledfft, "_launcher"), (tiledfft, "_kernel")):
            monkeypatch.setattr(module, "cuda_module", lambda *a, **k: self)
            monkeypatch.setattr(module, cached, functools.lru_cache(maxsize=None)(getattr(module, cached).__wrapped__))
        return self

    def _shared(self, real):
        def shared(key, owner, compute, *args):
            who = None if owner is None else self.watched.get(id(owner), ("made", tuple(owner.shape)))
            self.calls.append(("shared", key, who))
            return real(key, owner, compute, *args)
        return shared

    def _launcher(self, name):
        def make(n, B, *geometry):
            def launch(src, dst):
                self.calls.append((name, n, B, geometry, src.shape, dst.shape))
                return dst
            return launch
        return make

    def _gemm(self, a, b, out, op_a, op_b, accumulate):
        self.calls.append(("gemm", a.shape, b.shape, op_a, op_b, accumulate))
        return out if out is not None else np.empty(_product_shape(a.shape, b.shape, op_a, op_b), a.dtype)

    def matmul(self, xp, a, b, out=None, op_a="N", op_b="N", accumulate=False, strict=False):
        assert xp is self and not strict
        return self._gemm(a, b, out, op_a, op_b, accumulate)

    def prepare_gemm(self, xp, a_shape, b_shape, dtype=np.complex64, op_a="N", op_b="N", strict=False):
        assert xp is self and not strict and np.dtype(dtype) in (np.complex64, np.float32)   # the FFTs', winograd's

        def gemm(a, b, out=None, accumulate=False):
            assert (a.shape, b.shape) == (a_shape, b_shape), "run on the shapes it was prepared for"
            assert a.dtype == b.dtype == dtype, "run on the dtype it was prepared for"
            return self._gemm(a, b, out, op_a, op_b, accumulate)
        return gemm

    def get_function(self, name):
        return lambda grid, block, args, **kw: self.calls.append((name, grid, block, _plain(args), kw))

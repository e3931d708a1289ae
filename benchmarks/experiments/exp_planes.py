"""Experiment (not a benchmark of record): planes per block of the n = 8, 16 FFT kernels.

Small batches under-fill the 132 SMs of an H200 (n = 8, batch 4096: 64 blocks of 64 planes), so
fewer planes per block might lift the inverse FFT to the 2x-cuFFT target there. Compiles
fbfft.cu with -DFBFFT_PLANES_<n> overrides and times each variant against cuFFT; the outcome is
in benchmarks/NOTES.md.

  python -m benchmarks.experiments.exp_planes
"""
import argparse

from benchmarks.bench_fft import gpu_time_ms
from benchmarks.harness import RESULTS_DIR, provenance, rel_error, write_results


def main():
    ap = argparse.ArgumentParser(description="planes per block of the n = 8, 16 FFT kernels")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args()

    import cupy as cp
    import cupyx.scipy.fft as cpx_fft
    import numpy as np
    from cupy.cuda import cufft

    from minitorch_fft.backends import tuning
    from minitorch_fft.backends.common import KERNEL_DIR
    from minitorch_fft.backends.fbfft_plan import compact, stored_frequencies

    src = (KERNEL_DIR / "fbfft.cu").read_text()
    rows = []
    for n, variants in ((8, (64, 32, 16)), (16, (32, 16, 8))):
        rows_ = n // 2
        for planes in variants:
            mod = cp.RawModule(code=src, options=("--std=c++17", f"-DFBFFT_PLANES_{n}={planes}"),
                               name_expressions=(f"fbfft_rfft2<{n}>", f"fbfft_irfft2<{n}>"))
            f, g = mod.get_function(f"fbfft_rfft2<{n}>"), mod.get_function(f"fbfft_irfft2<{n}>")
            col = planes + 16 // rows_
            smem = rows_ * n * col * 8
            threads = rows_ * planes
            for B in (4096, 16384, 65536):
                x = cp.random.standard_normal((B, n, n), dtype=cp.float32)
                F = cp.empty((stored_frequencies(n), B), cp.complex64)
                y = cp.empty_like(x)
                grid = ((B + planes - 1) // planes,)
                fwd = lambda: f(grid, (threads,), (x, F, np.int32(B), np.int32(n), np.int32(n), np.int32(0), np.int32(0)), shared_mem=smem)
                inv = lambda: g(grid, (threads,), (F, y, np.int32(B), np.int32(0), np.int32(0), np.int32(n), np.int32(n), np.float32(1 / n / n)), shared_mem=smem)
                fwd(); inv()
                ref = compact(cp.fft.rfft2(x).transpose(1, 2, 0), n)
                e1, e2 = rel_error(F, ref), rel_error(y, x)
                tf, ti = gpu_time_ms(fwd), gpu_time_ms(inv)
                spec = cp.fft.rfft2(x); spec_in = spec.copy()
                pf = cpx_fft.get_fft_plan(x, axes=(1, 2), value_type="R2C"); of = cp.empty(spec.shape, cp.complex64)
                cf = gpu_time_ms(lambda: pf.fft(x, of, cufft.CUFFT_FORWARD))
                pi = cpx_fft.get_fft_plan(spec, shape=(n, n), axes=(1, 2), value_type="C2R"); oi = cp.empty_like(x)
                ci = gpu_time_ms(lambda: pi.fft(spec, oi, cufft.CUFFT_INVERSE), before=lambda: cp.copyto(spec, spec_in))
                rows.append(dict(n=n, planes=planes, batch=B, fwd_ms=tf, inv_ms=ti, x_fwd=cf / tf, x_inv=ci / ti,
                                 err_fwd=e1, err_inv=e2))
    cols = [("n", "n", ""), ("planes per block", "planes", ""), ("batch", "batch", ""), ("fwd ms", "fwd_ms", ".4f"),
            ("inv ms", "inv_ms", ".4f"), ("x cuFFT fwd", "x_fwd", ".2f"), ("x cuFFT inv", "x_inv", ".2f"),
            ("err fwd", "err_fwd", ".1e"), ("err inv", "err_inv", ".1e")]
    meta = provenance(tuning.device_name(cp), cupy=cp.__version__)
    paths = write_results("exp_planes", meta, rows, cols, "Experiment: planes per block, fbfft n = 8 and 16",
                          "Median ms (bench_fft.gpu_time_ms); x cuFFT = cuFFT plan time / fbfft time; the "
                          "defaults are 64 (n = 8) and 32 (n = 16).", out_dir=args.out, subdir="experiments")
    print(paths[1].read_text())


if __name__ == "__main__":
    main()

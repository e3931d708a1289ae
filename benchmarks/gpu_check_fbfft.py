"""One-shot GPU check of the fbfft kernels: build info, correctness, speed. Self-checking.

  python -m benchmarks.gpu_check_fbfft                   # from the repository root
  python -m benchmarks.gpu_check_fbfft --out /some/dir  # also writes gpu_check_fbfft.json/.md there
  python -m benchmarks.gpu_check_fbfft --no-timing      # parts 1-2 only

1. Kernel attributes as the driver sees them (registers, local memory = spills, static
   shared memory, resident blocks per SM).
2. Correctness of every size against cupy.fft (cuFFT): forward with implicit padding,
   inverse with clipping, outputs poisoned with NaN first (an element never written fails),
   a batch that leaves the last block partly empty, and a large-batch round trip. Maximum
   relative (norm-wise) error per size; must be <= 1e-5.
3. Timing against cuFFT, 2-D, n in 8..128, batch in 256..65536 (bench_fft.py), with the
   project's targets checked by bench_fft.targets: forward >= 1.5x cuFFT and inverse >= 2x
   at n <= 32, batch >= 4096; >= 50% of copy bandwidth for n in 16..64.
Exit status 1 if any correctness check fails (targets missed only print MISSED).
Takes about a minute; well under three.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from minitorch_fft.backends import config
from benchmarks import bench_fft
from benchmarks.harness import rel_error, write_text

TOL = 1e-5


def rel_err(got, ref):
    """rel_error; inf where an output element was never written (still NaN) or overflowed."""
    import cupy as cp
    if not bool(cp.all(cp.isfinite(got))):
        return float("inf")
    return rel_error(got, ref)


def kernel_info(fbfft_kernels, model):
    """Every kernel's registers, local memory and occupancy at its plan's launch (dynamic shared
    memory included)."""
    from cupy.cuda import driver
    rows = []
    plans = [(name, n, model.plan(n)) for n in model.SIZES for name in ("rfft2", "irfft2")]
    plans += [(name, n, model.plan1(n)) for n in model.SIZES_1D for name in ("rfft1", "irfft1")]
    for name, n, p in plans:
        k = fbfft_kernels.kernel(name, n)
        width = p.planes if name.endswith("2") else p.signals
        try:
            blocks = driver.occupancyMaxActiveBlocksPerMultiprocessor(k.kernel.ptr, p.threads, p.smem_bytes)
        except Exception:
            blocks = None
        rows.append(dict(kernel=f"fbfft_{name}<{n}>", registers=k.num_regs, local_bytes=k.local_size_bytes,
                         smem_bytes=p.smem_bytes, threads=p.threads, planes_per_block=width,
                         blocks_per_sm=blocks, warps_per_sm=None if blocks is None else blocks * p.threads // 32))
    return rows


def correctness(fbfft_kernels, model):
    """{n: {'fwd': max rel err, 'inv': max rel err}} plus a list of failure strings."""
    import cupy as cp
    rng = np.random.default_rng(int(time.time()))  # fresh data every run
    results, failures = {}, []
    for n in model.SIZES:
        planes = model.plan(n).planes
        nh = n // 2 + 1
        fwd_err = 0.0
        h2, w2 = max(1, n - 3), nh
        for B, h, w, top, left in [(5, n, n, 0, 0), (3 * planes + 5, h2, w2, min(2, n - h2), min(1, n - w2)),
                                   (3, 1, 1, n - 1, n - 1), (planes, n // 2, n, n // 2, 0)]:
            x = cp.asarray(rng.standard_normal((B, h, w)).astype(np.float32))
            out = cp.full((model.stored_frequencies(n), B), np.nan, dtype=np.complex64)
            fbfft_kernels.rfft2(x, n, (top, left), out=out)
            P = cp.zeros((B, n, n), dtype=np.float32)
            P[:, top:top + h, left:left + w] = x
            e = rel_err(out, model.compact(cp.fft.rfft2(P).transpose(1, 2, 0), n))
            fwd_err = max(fwd_err, e)
            if not e <= TOL:
                failures.append(f"rfft2 n={n} B={B} {h}x{w} at ({top},{left}): rel err {e:.2e}")
        inv_err = 0.0
        B = 3 * planes + 5
        P = cp.asarray(rng.standard_normal((B, n, n)).astype(np.float32))
        spec = cp.fft.rfft2(P)
        F = cp.ascontiguousarray(model.compact(spec.transpose(1, 2, 0), n))
        full = cp.fft.irfft2(spec, s=(n, n))
        for oh, ow, ro, co in [(n, n, 0, 0), (max(1, n - 3), nh, min(2, 3 if n > 4 else 1), 1 if n > 2 else 0),
                               (1, 1, n - 1, n - 1), (n // 2, n // 2, n // 2, n // 2)]:
            out = cp.full((B, oh, ow), np.nan, dtype=np.float32)
            fbfft_kernels.irfft2(F, n, (oh, ow), (ro, co), out=out)
            e = rel_err(out, full[:, ro:ro + oh, co:co + ow])
            inv_err = max(inv_err, e)
            if not e <= TOL:
                failures.append(f"irfft2 n={n} B={B} window {oh}x{ow} at ({ro},{co}): rel err {e:.2e}")
        results[n] = {"fwd": fwd_err, "inv": inv_err}
    # a large batch (many blocks, partial last block), padded and clipped round trip
    x = cp.random.standard_normal((70001, 13, 13), dtype=np.float32)
    y = fbfft_kernels.irfft2(fbfft_kernels.rfft2(x, 16, (1, 2)), 16, (13, 13), (1, 2))
    e = rel_err(y, x)
    results["round_trip_16_B70001"] = e
    if not e <= TOL:
        failures.append(f"round trip n=16 B=70001: rel err {e:.2e}")
    # an unsupported size must raise, never run silently
    try:
        fbfft_kernels.rfft2(x, 12)
        failures.append("rfft2 with n=12 did not raise")
    except ValueError:
        pass
    return results, failures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="also write gpu_check_fbfft.json/.md here")
    parser.add_argument("--no-timing", action="store_true", help="parts 1-2 only")
    args = parser.parse_args(argv)
    import cupy as cp

    from minitorch_fft.backends import fbfft_kernels
    from minitorch_fft.backends import fbfft_plan as model

    t0 = time.time()
    report = {"device": bench_fft.device_name(), "cupy": cp.__version__,
              "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
              "driver": cp.cuda.runtime.driverGetVersion()}
    try:
        from cupy.cuda import cufft
        report["cufft"] = cufft.getVersion()
    except Exception as exc:
        report["cufft"] = repr(exc)
    print(" ".join(f"{k}={v}" for k, v in report.items()), flush=True)

    t = time.time()
    info = kernel_info(fbfft_kernels, model)
    report["compile_s"] = time.time() - t
    report["kernels"] = info
    print(f"\n== kernels (NVRTC compile {report['compile_s']:.1f} s)")
    print("kernel              regs  local  smem    threads planes  blocks/SM warps/SM")
    for k in info:
        print(f"{k['kernel']:<19} {k['registers']:>4} {k['local_bytes']:>6} {k['smem_bytes']:>6} "
              f"{k['threads']:>8} {k['planes_per_block']:>6} {str(k['blocks_per_sm']):>10} {str(k['warps_per_sm']):>8}")
    spills = [k["kernel"] for k in info if k["local_bytes"]]

    print("\n== correctness vs cupy.fft (max relative error, tolerance %.0e)" % TOL, flush=True)
    with config.override(fbfft_check=True):        # synchronise and check after every launch
        results, failures = correctness(fbfft_kernels, model)
    for n in model.SIZES:
        print(f"n={n:<3} rfft2 {results[n]['fwd']:.2e}  irfft2 {results[n]['inv']:.2e}")
    print(f"round trip n=16 B=70001 (padded, clipped): {results['round_trip_16_B70001']:.2e}")
    for f in failures:
        print("FAIL", f)
    if spills:
        print("NOTE local memory (spills) in:", ", ".join(spills))
    print("correctness:", "PASS" if not failures else f"FAIL ({len(failures)})", flush=True)
    report["correctness"] = {str(k): v for k, v in results.items()}
    report["failures"] = failures

    if args.no_timing:
        report["total_s"] = time.time() - t0
        print(f"\n(timing skipped: python -m benchmarks.bench_fft times both dims)\ntotal {report['total_s']:.0f} s")
        if args.out:
            write_text(args.out / "gpu_check_fbfft.json", json.dumps(report, indent=1, default=str))
        sys.exit(1 if failures else 0)

    print("\n== timing (median of CUDA events, host launch overhead excluded)", flush=True)
    copy_gbs = bench_fft.copy_bandwidth_gbs()
    rows = bench_fft.run(log=lambda s: print(s, flush=True))
    table = bench_fft.format_table(rows, copy_gbs)
    print(table)
    checks = bench_fft.targets(rows, copy_gbs)  # the table above ends with them too
    report.update(copy_gbs=copy_gbs, timing=rows,
                  targets=[dict(target=text, ok=bool(ok)) for text, ok in checks],
                  total_s=time.time() - t0)
    print(f"\ntotal {report['total_s']:.0f} s")

    if args.out:
        write_text(args.out / "gpu_check_fbfft.json", json.dumps(report, indent=1, default=str))
        write_text(args.out / "gpu_check_fbfft.md", f"# fbfft GPU check, {report['device']}\n\n{table}\n")
        print(f"wrote {args.out}/gpu_check_fbfft.json")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

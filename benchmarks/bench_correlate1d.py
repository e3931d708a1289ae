"""Benchmark: the 1-D case of the walk-through (../shared/papers/1d-convolution-cuda-walkthrough.txt).

One float32 signal of 1,000,000 samples, valid cross-correlation with a mask of 2047 taps
(output[i] = sum_j input[i + j] mask[j], i < 1,000,000 - 2047 + 1), plus a sweep of mask
lengths around it. The direct backend's register-blocked kernel (backends/correlate1d.py:
correlate1d, autotuned over its configurations; every configuration is reported) against
cupyx.scipy.signal.correlate with method "auto" (its own choice, which may be the FFT),
"direct" and "fft". Every result is checked against float64 (PyTorch's conv1d on the GPU, a
cross-correlation) before it is timed; times are medians of CUDA events after warm-up, on fresh
random data. GFLOP/s counts 2 * K * n_out (one multiply and one add per tap and output), the
walk-through's measure; its T4 figures are quoted for reference, not re-measured.

  python -m benchmarks.bench_correlate1d                  # the sweep (~1 min on an H100)
  python -m benchmarks.bench_correlate1d --masks 2047     # the walk-through's case only

Writes results/<device>/correlate1d.{json,md,png}.
"""
import argparse
import sys
import time
from pathlib import Path

from benchmarks.harness import RESULTS_DIR, median_ms, provenance, rel_error, save_figure, slug, write_results

LENGTH = 1_000_000
MASKS = (15, 63, 255, 1023, 2047, 4095)
HEADLINE_MASK = 2047
TOLERANCE = 1e-5
SLOW_MS = 200  # a cupyx method slower than this once is timed once, not repeated
# Quoted from the walk-through (NVIDIA T4, input 1,000,000, mask 2047), best kernel "micro_opt".
QUOTED_T4 = {"ms": 0.868636, "GFLOPS": 4713.14}
CUPYX_METHODS = ("auto", "direct", "fft")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=LENGTH, help="signal length (default %(default)s)")
    parser.add_argument("--masks", default=",".join(map(str, MASKS)), help="comma-separated mask lengths")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder (default results/)")
    args = parser.parse_args(argv)
    args.masks = [int(m) for m in args.masks.split(",")]
    return args


def gflops(K, n_out, ms):
    return 2.0 * K * n_out / (ms * 1e-3) / 1e9


def bench_mask(K, args, rng):
    import cupy as cp
    import cupyx.scipy.signal as sig
    import torch

    from minitorch_fft.backends import tuning
    from minitorch_fft.backends.correlate1d import correlate1d
    L = args.length
    n_out = L - K + 1
    x = rng.standard_normal(L, dtype=cp.float32)
    mask = rng.standard_normal(K, dtype=cp.float32)
    ref = cp.asarray(torch.nn.functional.conv1d(
        torch.as_tensor(x, device="cuda").double().view(1, 1, L),
        torch.as_tensor(mask, device="cuda").double().view(1, 1, K)).view(n_out))
    row = {"L": L, "K": K, "n_out": n_out}
    row["err_direct"] = rel_error(correlate1d(x, mask), ref)     # tunes on first call
    entry = tuning.default_cache().get(tuning.key(cp, "float32", (1, L, K), "correlate1d", "direct"))
    if isinstance(entry, dict):
        row["direct_config"] = entry.get("choice")          # "OUTxTHREADS"
        row["direct_tuning_ms"] = {c: round(t, 4) for c, t in entry.get("ms", {}).items()}
    row["ms_direct"] = median_ms(lambda: correlate1d(x, mask), "cupy", args.warmup, args.repeat)
    row["GFLOPS_direct"] = gflops(K, n_out, row["ms_direct"])
    try:
        row["cupyx_auto_choice"] = sig.choose_conv_method(x, mask, mode="valid")
    except (AttributeError, TypeError) as e:  # older CuPy: the choice is not exposed
        row["cupyx_auto_choice"] = f"unknown ({type(e).__name__})"
    for method in CUPYX_METHODS:
        def run(method=method):
            return sig.correlate(x, mask, mode="valid", method=method)
        t0 = time.perf_counter()
        out = run()
        cp.cuda.Device().synchronize()
        once_ms = (time.perf_counter() - t0) * 1e3
        row[f"err_cupyx_{method}"] = rel_error(out, ref)
        del out
        warm, rep = (0, 1) if once_ms > SLOW_MS else (args.warmup, args.repeat)
        ms = median_ms(run, "cupy", warm, rep)
        row[f"ms_cupyx_{method}"] = ms
        row[f"GFLOPS_cupyx_{method}"] = gflops(K, n_out, ms)
        row[f"x_cupyx_{method}"] = ms / row["ms_direct"]
    print(f"K={K:5d}: direct {row['ms_direct']:.4f} ms ({row['GFLOPS_direct']:.0f} GFLOP/s, "
          f"{row.get('direct_config')}), cupyx auto({row['cupyx_auto_choice']}) "
          f"{row['ms_cupyx_auto']:.4f} ms, direct {row['ms_cupyx_direct']:.4f}, fft {row['ms_cupyx_fft']:.4f}",
          flush=True)
    return row


def failures(rows):
    bad = []
    for r in rows:
        for key in [k for k in r if k.startswith("err_")]:
            if not r[key] <= TOLERANCE:
                bad.append(f"K={r['K']} {key[4:]}: relative error {r[key]:.2e} > {TOLERANCE}")
    return bad


def plot(rows, path, device):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    Ks = [r["K"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(Ks, [r["GFLOPS_direct"] for r in rows], "o-", label="direct (ours)")
    for method in CUPYX_METHODS:
        ax.plot(Ks, [r[f"GFLOPS_cupyx_{method}"] for r in rows], "s--", label=f"cupyx correlate, {method}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("mask length K")
    ax.set_ylabel("GFLOP/s (2 K n_out / time)")
    ax.set_title(f"1-D valid correlation, input {rows[0]['L']:,}\n{device}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    import cupy as cp
    import torch

    from minitorch_fft.backends import tuning
    if not torch.cuda.is_available():
        sys.exit("bench_correlate1d needs a CUDA GPU")
    device = tuning.device_name(cp)
    meta = provenance(device, cupy=cp.__version__, torch=torch.__version__, length=args.length,
                      warmup=args.warmup, repeat=args.repeat, seed=args.seed,
                      quoted_walkthrough_T4=QUOTED_T4)
    rng = cp.random.default_rng(args.seed)
    rows = [bench_mask(K, args, rng) for K in args.masks]
    bad = failures(rows)
    columns = [("K", "K", ""), ("direct ms", "ms_direct", ".4f"), ("direct GFLOP/s", "GFLOPS_direct", ".0f"),
               ("config (OUT x threads)", "direct_config", ""),
               ("cupyx auto ms", "ms_cupyx_auto", ".4f"), ("auto picks", "cupyx_auto_choice", ""),
               ("cupyx direct ms", "ms_cupyx_direct", ".4f"), ("cupyx fft ms", "ms_cupyx_fft", ".4f"),
               ("x auto", "x_cupyx_auto", ".2f"), ("x direct", "x_cupyx_direct", ".2f"),
               ("x fft", "x_cupyx_fft", ".2f"), ("direct err", "err_direct", ".1e")]
    head = [r for r in rows if r["K"] == HEADLINE_MASK]
    notes = ("Valid cross-correlation of one float32 signal; x = cupyx time / direct time (> 1: ours "
             "is faster). Relative errors against float64 (PyTorch conv1d). The walk-through's best "
             f"kernel on an NVIDIA T4 (quoted, not measured here): {QUOTED_T4['ms']} ms, "
             f"{QUOTED_T4['GFLOPS']} GFLOP/s.")
    if head:
        h = head[0]
        notes += (f"\n\nHeadline (input {h['L']:,}, mask {h['K']}): direct {h['ms_direct']:.4f} ms = "
                  f"{h['GFLOPS_direct']:.0f} GFLOP/s; {h['x_cupyx_auto']:.2f}x cupyx correlate "
                  f"(auto, which picks {h['cupyx_auto_choice']}), {h['x_cupyx_direct']:.2f}x its direct "
                  f"method, {h['x_cupyx_fft']:.2f}x its FFT method.")
    if bad:
        notes += "\n\nFAILED CHECKS:\n" + "\n".join(bad)
    json_path, md_path = write_results("correlate1d", meta, rows, columns,
                                       "1-D correlation (the walk-through's case): direct vs cupyx",
                                       notes, out_dir=args.out)
    png = Path(args.out) / slug(device) / "correlate1d.png"
    plot(rows, png, device)
    print(f"\nwrote {json_path}, {md_path}, {png}")
    print(notes)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

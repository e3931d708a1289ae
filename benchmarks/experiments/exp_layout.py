"""Experiment (not a benchmark of record): the cufft backend against an earlier version of itself.

An A/B of one pipeline change at a fixed configuration: the earlier file and the current backend
in each of its spectrum layouts (cufft.LAYOUTS) run untuned (smallest basis, strided-batched
GEMM), in one process, interleaved round by round, on the same fresh random data per layer.
Each pass of each version is first checked against PyTorch in float64.

  git show f023745:backends/cufft.py > /tmp/cufft_f023745.py
  python -m benchmarks.experiments.exp_layout --baseline /tmp/cufft_f023745.py --label f023745

The question it was written for (benchmarks/NOTES.md, session 5): does cuFFT's advanced layout
(spectra written and read frequency-major by the FFT plans themselves) beat rfft2 + a transpose
copy each way? Writes results/<device>/experiments/exp_layout.{json,md}.
"""
import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

from minitorch_fft.backends import config
from benchmarks.harness import NETWORK_LAYERS as LAYERS
from benchmarks.harness import PASSES, RESULTS_DIR, Layer, median_ms, provenance, rel_error, write_results

DEFAULT_LAYERS = ("table4.L2", "table4.L3", "table4.L4", "table4.L5", "alexnet.conv2",
                  "alexnet.conv3", "overfeat.conv3")
TOLERANCE = 1e-4


def load_baseline(path):
    """The file at `path` as the module minitorch_fft.backends._baseline_cufft (its relative imports
    resolve in minitorch_fft.backends)."""
    spec = importlib.util.spec_from_file_location("minitorch_fft.backends._baseline_cufft", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def calls(module, layout, x, w, gy, padding):
    """The three passes of `module`, in `layout` where it has layouts (None: an earlier file)."""
    def run(fn, *args):
        def call():
            if layout is not None:
                module.DEFAULT_LAYOUT = layout               # read by default_config (untuned)
            return fn(*args, padding=padding)
        return call
    return {"fprop": run(module.fprop, x, w), "bprop": run(module.bprop, gy, w, x.shape),
            "accgrad": run(module.accgrad, gy, x, w.shape)}


def measure(args, names, versions, cufft):
    """The rows: every version's passes on each layer, checked, then timed in interleaved rounds."""
    from tqdm import tqdm
    rows = []
    for name in tqdm(names, desc="layers"):
        f, fo, h, k, pad = LAYERS[name]
        layer = Layer((128, f, h, h), (fo, f, k, k), (1, 1), (pad, pad), seed=0)  # data, float64 refs
        x, w, gy = layer.x, layer.w, layer.gy
        fns = {label: calls(m, layout, x, w, gy, (pad, pad)) for label, (m, layout) in versions.items()}
        for p in PASSES:
            row = {"layer": name, "pass": p, "basis": "x".join(map(str, cufft.default_config(layer.g)["basis"]))}
            for label in versions:
                err = rel_error(fns[label][p](), layer.ref[p])
                if not err <= TOLERANCE:
                    raise SystemExit(f"{label} {name} {p}: relative error {err:.2e} > {TOLERANCE}")
                row[f"err_{label}"] = err
            times = {label: [] for label in versions}
            for r in range(args.rounds):
                order = list(versions) if r % 2 == 0 else list(versions)[::-1]
                for label in order:
                    times[label].append(median_ms(fns[label][p], "cupy"))
            for label in versions:
                row[f"ms_{label}"] = statistics.median(times[label])
            for layout in cufft.LAYOUTS:
                row[f"x_{layout}"] = row[f"ms_{args.label}"] / row[f"ms_{layout}"]
            rows.append(row)
        for m, _ in versions.values():
            m.release_buffers()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--baseline", type=Path, required=True, help="an earlier backends/cufft.py")
    ap.add_argument("--label", default="baseline", help="what to call the baseline in the table")
    ap.add_argument("--layers", default=",".join(DEFAULT_LAYERS), help="bench_cufft layer names")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median taken)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    names = [n.strip() for n in args.layers.split(",") if n.strip()]
    if not args.baseline.is_file() or any(n not in LAYERS for n in names) or args.rounds < 1:
        ap.error(f"need an existing --baseline file, layers from {', '.join(LAYERS)}, --rounds >= 1")

    import cupy as cp

    from minitorch_fft.backends import cufft, tuning
    baseline = load_baseline(args.baseline)
    versions = {args.label: (baseline, None), **{layout: (cufft, layout) for layout in cufft.LAYOUTS}}
    if hasattr(baseline, "TUNE"):   # an earlier file, from before backends.config: its own switch
        baseline.TUNE = "off"
    with config.override(cufft_tune="off"):          # same configuration on every side
        rows = measure(args, names, versions, cufft)
    cols = [("layer", "layer", ""), ("pass", "pass", ""), ("basis", "basis", "")]
    cols += [(f"{label} ms", f"ms_{label}", ".3f") for label in versions]
    cols += [(f"{layout} x {args.label}", f"x_{layout}", ".2f") for layout in cufft.LAYOUTS]
    cols += [(f"{label} err", f"err_{label}", ".1e") for label in versions]
    meta = provenance(tuning.device_name(cp), cupy=cp.__version__, baseline=str(args.label))
    paths = write_results("exp_layout", meta, rows, cols,
                          f"Experiment: the cufft backend's layouts against {args.label}",
                          f"Batch 128, all untuned (smallest basis, batched GEMM). ms = median over "
                          f"{args.rounds} interleaved rounds of median_ms (3 warm-up, 10 timed, CUDA "
                          f"events); <layout> x {args.label} = {args.label} ms / that layout's ms; err = "
                          "relative error against PyTorch float64.", out_dir=args.out, subdir="experiments")
    print(paths[1].read_text())


if __name__ == "__main__":
    main()

"""Experiment (not a benchmark of record): winograd's batch chunks at several bounds, TRANSIENT_FACTOR
values (--factors), TRANSIENT_FLOOR values (--floors), MIN_CHUNK_FLOP values (--min-chunk-gflop) or accGrad's
ROW_FACTOR values (--row-factors), side by side in one process, per layer and pass.

Session 32 (benchmarks/NOTES.md): converted OverFeat-fast's TF32 step under torch.compile peaked
67 MiB above PyTorch's, during conv5's fprop. There a chunk held its tiles and GEMM output: 288 MiB,
twice the pass's operands (TRANSIENT_FACTOR 2). Branch s32-winograd-transients (factor 1: three
chunks of 43 images) brought the peak under PyTorch's. It ran on another machine, though, and its
step was 3 % slower in a CUDA graph. This measures the cost of the smaller chunks apart from the
host. (Session 33 ran it, then bounded bprop alone at once its operands: TRANSIENT_FACTOR is per
pass since, and the factors given here are the measured pass's, the others' left as they are.)
Session 56: converted OverFeat-fast's TF32 step under reduce-overhead peaked 39 MiB over PyTorch's
in conv5's bprop, whose chunks the floor sets there (its operands are under it); --floors measures
what another floor costs (TRANSIENT_FLOOR: one value for every pass, one pass measured at a time),
the factors left as they are. Its runs, and why the floor stayed: benchmarks/NOTES.md, session 56.
Session 57: fprop's and bprop's weight transform counts against the floor where each chunk's GEMMs
keep MIN_CHUNK_FLOP of work; --min-chunk-gflop compares values of it (a large one: the transform never
counted, as before; 0: always).
Session 58: the step's peak was conv5's accGrad chunk (tiles twice its operands); its tiles are made in
row parts of at most ROW_FACTOR times the operands (or the floor); --row-factors compares values of it
(inf: no parts, as before), and the rows report the parts each chunk ran in.

Per layer, pass and bound it reports:
- the chunks the pass ran (count, images in the first);
- the memory the pass takes beyond its inputs from an emptied CuPy pool (harness.peak_extra_bytes:
  the pool's new bytes after one call, an upper bound on the pass's peak, since the pool does not
  reuse a freed block for a larger request; 0 on NumPy), beside its operands';
- the median time (CUDA events; the factors take turns, round by round, so drift on the device
  falls on both);
- the relative difference between the factors' results.

The tile is the mode's: F(2x2) in TF32 mode (--tf32); in strict fp32 the one winograd tunes (its
tuning cache is backends.config's). accGrad's group count is tuned per chunk size, so each factor
tunes its own in the first round's warm-up.

  python -m benchmarks.experiments.exp_winograd_chunks --tf32
  python -m benchmarks.experiments.exp_winograd_chunks --layers overfeat_fast.conv5 --factors 2,1 --rounds 5
  python -m benchmarks.experiments.exp_winograd_chunks --tf32 --passes bprop --floors 256,192,128 \
      --layers overfeat_fast.conv3,overfeat_fast.conv4,overfeat_fast.conv5
  python -m benchmarks.experiments.exp_winograd_chunks --passes fprop,bprop --min-chunk-gflop 1e9,38,0 \
      --layers overfeat_fast.conv4,overfeat_fast.conv5,vgg16.conv4_2
  python -m benchmarks.experiments.exp_winograd_chunks --tf32 --passes accgrad --row-factors inf,1 \
      --layers overfeat_fast.conv4,overfeat_fast.conv5,vgg16.conv4_2
"""
import argparse
import functools
import math
import statistics
import sys

import numpy as np

from minitorch_fft.backends import config, winograd
from benchmarks import bench_winograd
from benchmarks.harness import PASSES, RESULTS_DIR, median_ms, peak_extra_bytes, provenance, write_results

# name: (f, f', h = w, batch), as bench_winograd's table (3x3, stride 1, padding 1), and
# OverFeat-fast's two 1024-plane layers, where auto runs winograd in TF32 mode
LAYERS = {**{name: bench_winograd.LAYERS[name] for name in ("vgg16.conv1_2", "vgg16.conv4_2", "vgg16.conv5_1")},
          "overfeat_fast.conv3": (256, 512, 12, 128),
          "overfeat_fast.conv4": (512, 1024, 12, 128),
          "overfeat_fast.conv5": (1024, 1024, 12, 128)}
COLUMNS = [("layer", "layer", ""), ("pass", "pass", ""), ("bound", "bound", ""), ("chunks", "chunks", ""),
           ("images a chunk", "chunk_images", ""), ("row parts", "row_parts", ""),
           ("operands MiB", "operands_mib", ".1f"),
           ("pool MiB", "pool_mib", ".1f"), ("ms", "ms", ".3f"), ("ms by round", "ms_rounds", ""),
           ("vs the first bound", "vs_first_bound", ".3f"), ("rel diff", "rel_diff", ".1e")]


def run(pass_name, arrays):
    """One call of winograd's pass on the layer's arrays (x, w, gy)."""
    x, w, gy = arrays
    if pass_name == "fprop":
        return winograd.fprop(x, w, padding=(1, 1))
    if pass_name == "bprop":
        return winograd.bprop(gy, w, x.shape, padding=(1, 1))
    return winograd.accgrad(gy, x, w.shape, padding=(1, 1))


KNOBS = ("TRANSIENT_FACTOR", "TRANSIENT_FLOOR", "MIN_CHUNK_FLOP", "ROW_FACTOR")   # winograd's bounds set here


def bounds(factors=None, floors_mib=None, min_gflop=None, row_factors=None):
    """[(label, (module's KNOBS, pass) -> the KNOBS the pass measured runs at)] for the bounds
    compared: one of TRANSIENT_FACTOR (the measured pass's), TRANSIENT_FLOOR, MIN_CHUNK_FLOP or
    ROW_FACTOR set."""
    if row_factors is not None:
        return [(f"rows {v:g}x", lambda base, p, v=v: {**base, "ROW_FACTOR": v}) for v in row_factors]
    if min_gflop is not None:
        return [(f"min {v:g} GFLOP", lambda base, p, v=v: {**base, "MIN_CHUNK_FLOP": v * 1e9}) for v in min_gflop]
    if floors_mib:
        return [(f"floor {v:g} MiB", lambda base, p, v=v: {**base, "TRANSIENT_FLOOR": int(v * 2**20)})
                for v in floors_mib]
    return [(f"factor {k}", lambda base, p, k=k: {**base, "TRANSIENT_FACTOR": {**base["TRANSIENT_FACTOR"], p: k}})
            for k in factors]


def measure(xp, names, compared, rounds, repeat, batch=None, passes=PASSES):
    """Rows of COLUMNS: every layer, pass and bound (`compared`: bounds())."""
    rows = []
    base = {name: getattr(winograd, name) for name in KNOBS}   # the module's
    labels = [label for label, _ in compared]
    lib = "cpu" if xp is np else "cupy"
    for name in names:
        f, fo, hw, S = LAYERS[name]
        S = batch or S
        rng = np.random.default_rng(0)
        arrays = [xp.asarray(rng.standard_normal(shape, dtype=np.float32))
                  for shape in ((S, f, hw, hw), (fo, f, 3, 3), (S, fo, hw, hw))]
        operands = (arrays[0].nbytes + arrays[2].nbytes) / 2**20
        for pass_name in passes:
            times = {k: [] for k in labels}
            out, memory, used, parts = {}, {}, {}, {}
            for r in range(rounds):
                for k, knobs_of in compared:
                    for knob, value in knobs_of(base, pass_name).items():
                        setattr(winograd, knob, value)
                    fn = functools.partial(run, pass_name, arrays)
                    if r == 0:
                        out[k], used[k], parts[k] = chunks_of(fn)   # tunes the tile and the groups
                        memory[k] = 0.0 if xp is np else peak_extra_bytes(fn, "cupy") / 2**20
                    times[k].append(median_ms(fn, lib, warmup=1, repeat=repeat))
            first = statistics.median(times[labels[0]])
            for k in labels:
                chunks = used[k]
                ms = statistics.median(times[k])
                diff = float(xp.linalg.norm(out[k] - out[labels[0]]) / xp.linalg.norm(out[labels[0]]))
                rows.append(dict(layer=name, **{"pass": pass_name}, bound=k, chunks=len(chunks),
                                 chunk_images=chunks[0].stop - chunks[0].start, row_parts=parts[k],
                                 operands_mib=round(operands, 1),
                                 pool_mib=round(memory[k], 1), ms=round(ms, 4),
                                 ms_rounds=[round(t, 4) for t in times[k]], vs_first_bound=round(first / ms, 3),
                                 rel_diff=diff))
                print(f"{name:20} {pass_name:8} {k}: {len(chunks)} chunk(s), {parts[k]} row part(s), "
                      f"pool {memory[k]:7.1f} MiB "
                      f"(operands {operands:.1f}), {ms:.3f} ms ({first / ms:.3f}x {labels[0]}), "
                      f"diff {diff:.1e}", flush=True)
        del arrays
    return rows


def chunks_of(fn):
    """(fn(), the batch slices winograd._conv_chunks gave the pass it ran, the row parts
    winograd._row_parts gave its accGrad, 1 for fprop and bprop): as run, the tile winograd chose
    included."""
    seen = {name: [] for name in ("_conv_chunks", "_row_parts")}
    own = {name: getattr(winograd, name) for name in seen}

    def recording(name):
        def call(*args):
            seen[name].append(own[name](*args))
            return seen[name][-1]
        return call
    for name in seen:
        setattr(winograd, name, recording(name))
    try:
        out = fn()
    finally:
        for name, function in own.items():
            setattr(winograd, name, function)
    if not seen["_conv_chunks"]:
        raise RuntimeError("the pass made no chunks: winograd._conv_chunks was not called")
    return out, seen["_conv_chunks"][-1], seen["_row_parts"][-1] if seen["_row_parts"] else 1


def _numbers(ap, option, text, kind, what):
    """text's comma-separated values as `kind` (int or float), or the parser's error naming option."""
    try:
        return [kind(v) for v in text.split(",")]
    except ValueError:
        ap.error(f"{option} takes {what} separated by commas, got {text!r}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="overfeat_fast.conv4,overfeat_fast.conv5,vgg16.conv1_2",
                    help="comma-separated, of: " + ", ".join(LAYERS))
    ap.add_argument("--factors", default=None, help="TRANSIENT_FACTOR values of the pass measured, the first "
                    "the baseline (default 2,1)")
    ap.add_argument("--floors", default=None, help="TRANSIENT_FLOOR values (MiB) of the pass measured, the first "
                    "the baseline, instead of --factors")
    ap.add_argument("--min-chunk-gflop", default=None, help="MIN_CHUNK_FLOP values in GFLOP (a chunk's GEMM work "
                    "under which fprop's and bprop's weight transform does not count against the floor), the first "
                    "the baseline, instead of --factors")
    ap.add_argument("--row-factors", default=None, help="accGrad's ROW_FACTOR values (its tiles made in row "
                    "parts of at most this times the operands, or the floor; inf: no parts), the first the "
                    "baseline, instead of --factors")
    ap.add_argument("--passes", default=",".join(PASSES), help="comma-separated, of: " + ", ".join(PASSES))
    ap.add_argument("--tf32", action="store_true", help="the framework's TF32 mode (Winograd F(2x2) alone)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=5, help="timed calls a round")
    ap.add_argument("--batch", type=int, default=None, help="one batch for every layer (default: the table's)")
    ap.add_argument("--cpu", action="store_true", help="NumPy (a smoke run: the chunking, not the GPU's times)")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)
    names = args.layers.split(",")
    unknown = [n for n in names if n not in LAYERS]
    if unknown:
        ap.error(f"unknown layer(s) {', '.join(unknown)}; choose from {', '.join(LAYERS)}")
    if sum(v is not None for v in (args.factors, args.floors, args.min_chunk_gflop, args.row_factors)) > 1:
        ap.error("give one of --factors, --floors, --min-chunk-gflop and --row-factors: one bound is varied at a time")
    factors = _numbers(ap, "--factors", args.factors or "2,1", int, "whole numbers")
    if min(factors) <= 0 or len(set(factors)) < len(factors):
        ap.error(f"--factors must be positive and distinct, got {args.factors!r}")
    floors = None
    if args.floors is not None:
        floors = _numbers(ap, "--floors", args.floors, float, "numbers of MiB")
        # whole bytes, each labelled apart ("floor {v:g} MiB"): no two may round to one
        if not all(math.isfinite(v) and int(v * 2**20) >= 1 for v in floors):
            ap.error(f"--floors must be finite and at least one byte (1/1048576 MiB), got {args.floors!r}")
        if len({int(v * 2**20) for v in floors}) < len(floors) or len({f"{v:g}" for v in floors}) < len(floors):
            ap.error(f"--floors must be distinct, got {args.floors!r}")
    min_gflop = None
    if args.min_chunk_gflop is not None:
        min_gflop = _numbers(ap, "--min-chunk-gflop", args.min_chunk_gflop, float, "numbers of GFLOP")
        distinct = len({f"{v:g}" for v in min_gflop}) == len(min_gflop)   # each labelled apart
        if not (all(math.isfinite(v) and v >= 0 for v in min_gflop) and distinct):
            ap.error(f"--min-chunk-gflop must be finite, at least 0 and distinct, got {args.min_chunk_gflop!r}")
    row_factors = None
    if args.row_factors is not None:
        row_factors = _numbers(ap, "--row-factors", args.row_factors, float, "numbers (inf: no parts)")
        if not (all(v > 0 for v in row_factors) and len({f"{v:g}" for v in row_factors}) == len(row_factors)):
            ap.error(f"--row-factors must be above 0 (inf allowed) and distinct, got {args.row_factors!r}")
    passes = args.passes.split(",")
    if any(p not in PASSES for p in passes) or len(set(passes)) < len(passes):
        ap.error(f"--passes takes a comma-separated list of distinct passes of {', '.join(PASSES)}, got "
                 f"{args.passes!r}")
    if args.batch is not None and args.batch < 1:
        ap.error(f"--batch must be at least 1, got {args.batch}")
    if args.rounds < 1 or args.repeat < 1:
        ap.error("--rounds and --repeat must be at least 1")
    if args.cpu:
        xp = np
    else:
        import cupy as xp
    saved = {name: getattr(winograd, name) for name in KNOBS}
    try:
        with config.override(tf32=args.tf32):
            rows = measure(xp, names, bounds(factors, floors, min_gflop, row_factors), args.rounds, args.repeat,
                           args.batch, passes)
    finally:
        for name, value in saved.items():
            setattr(winograd, name, value)
    device = "cpu-numpy" if xp is np else xp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    meta = provenance(device, command_line=" ".join(sys.argv[1:] if argv is None else argv), tf32=args.tf32,
                      factors=None if floors or min_gflop is not None or row_factors is not None else factors,
                      floors_mib=floors, min_chunk_gflop=min_gflop,
                      # JSON has no infinity: "inf" as a string (strict parsers refuse Infinity)
                      row_factors=row_factors and [v if math.isfinite(v) else str(v) for v in row_factors],
                      passes=passes, rounds=args.rounds, repeat=args.repeat)
    name = ("exp_winograd_chunks" + ("_floors" if floors else "") + ("_min_flop" if min_gflop is not None else "")
            + ("_rows" if row_factors is not None else "") + ("_tf32" if args.tf32 else ""))
    write_results(name, meta, rows, COLUMNS, "Winograd's batch chunks at several transient bounds, side by side",
                  out_dir=args.out, subdir="experiments")
    return rows


if __name__ == "__main__":
    main()

"""Experiment (not a benchmark of record): bench_pytorch's own process, probed. Its converted
AlexNet fp32 compiled row issued its step in 6.25-11.57 ms from process to process in session 68,
where exp_compile_gap's processes issued the same step in 6.8-8.8 (benchmarks/NOTES.md). This runs bench_pytorch
as it is (its arguments after ours, its files written as usual) and adds, per row:

  --gc       Python's garbage collections by generation, and their ms, over the row's timed_row
             (warm-up and timed steps; median_ms pauses the collector only while it times), with
             the objects alive at the row's start (two compiled models' worth, later on);
  --split N  for each converted row, eager and compiled, exp_compile_gap's issue split over N more
             steps right after its timed_row (issue ms = ms in our crossings + outside them, our
             crossings by kind, run_pass by pass): what the bench's process spends where.

Lines start with PROBE so that they can be read out of the bench's log.

  python -m benchmarks.experiments.exp_bench_probe --gc --split 20 -- --nets alexnet --impls strict,fp32 --compile
"""
import argparse
import gc
import sys
import time


def _collections():
    """[counts by generation], [seconds by generation]: a gc callback keeps them from now on."""
    counts, spent, started = [0, 0, 0], [0.0, 0.0, 0.0], {}

    def callback(phase, info):
        g = info["generation"]
        if phase == "start":
            started[g] = time.perf_counter()
        elif g in started:
            counts[g] += 1
            spent[g] += time.perf_counter() - started.pop(g)
    gc.callbacks.append(callback)
    return callback, counts, spent


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gc", action="store_true", help="count Python's collections over each row's timed_row")
    ap.add_argument("--split", type=int, default=0, metavar="N", help="split each converted row's issue time "
                    "over N steps (exp_compile_gap.issue_split)")
    args = ap.parse_args(ours)

    from benchmarks import bench_pytorch as bp
    from benchmarks.experiments.exp_compile_gap import issue_split
    from minitorch_fft import pytorch as pt
    callback, counts, spent = _collections() if args.gc else (None, None, None)
    timed_row, compiled_row, convert = bp.timed_row, bp._compiled_row, pt.convert
    row = {"name": None}   # the converted row whose steps timed_row runs (None: a stock row)

    def probed(step, bench, *rest, **kwargs):
        objects = len(gc.get_objects()) if args.gc else 0
        n0, s0 = (list(counts), list(spent)) if args.gc else (None, None)
        result = timed_row(step, bench, *rest, **kwargs)
        if args.gc:
            n = [a - b for a, b in zip(counts, n0)]
            ms = [round((a - b) * 1e3, 2) for a, b in zip(spent, s0)]
            print(f"PROBE gc: {objects} objects at the row's start; collections by generation {n}, ms {ms}, over "
                  f"its timed_row (issue {result[2]:.2f} ms, step {result[0]:.2f})", flush=True)
        if args.split and row["name"] is not None and result[2] > 0.5:   # not a graph row's replay
            (issue, in_ours, framework, _, _), _, per_pass, _, by_kind = issue_split(step, args.split)
            print(f"PROBE split {row['name']}: issue {issue:.2f} ms = {in_ours:.2f} in our crossings (run_pass "
                  f"{framework:.2f}) + {issue - in_ours:.2f} outside; by kind "
                  + ", ".join(f"{k} {ms:.3f}" for k, ms in by_kind), flush=True)
            for us, pass_name, x_shape, _, picked in per_pass:
                print(f"PROBE split    {us:7.1f} us  {pass_name:8s} {picked:10s} x {x_shape}", flush=True)
        return result

    def compiled(model, opt, scope, x, y, bench, net, label, *rest):
        converted = any(isinstance(m, pt.Conv2d) for m in model.modules())
        row["name"] = f"{label} compiled" if converted else None
        try:
            return compiled_row(model, opt, scope, x, y, bench, net, label, *rest)
        finally:
            row["name"] = None

    def converting(model, *a, **k):   # run_network converts each converted row's model; the eager rows of
        row["name"] = "converted eager"   # the stock models all come before (bench_pytorch.IMPLS' order); its
                                          # precision is the bench log's next row's
        return convert(model, *a, **k)
    def network(*a, **k):              # each network starts with its stock rows
        row["name"] = None
        return run_network(*a, **k)
    run_network = bp.run_network
    bp.timed_row, bp._compiled_row, bp.run_network, pt.convert = probed, compiled, network, converting
    argv_was, sys.argv = sys.argv, ["bench_pytorch", *bench_args]
    try:
        bp.main()
    finally:
        bp.timed_row, bp._compiled_row, bp.run_network, pt.convert = timed_row, compiled_row, run_network, convert
        sys.argv = argv_was
        if callback is not None:
            gc.callbacks.remove(callback)


if __name__ == "__main__":
    main()

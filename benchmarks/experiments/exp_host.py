"""Experiment (not a benchmark of record): where the host time of a convolution pass goes.

profile_layers puts about 1 ms of AlexNet's 5.9 ms conv total (batch 128, H200, session 5)
outside GPU kernels: Python issuing each pass's launches while the GPU waits. This times, for
every conv layer and pass of a network under a backend setting (auto by default), the host
time of one call (perf_counter around the call, no synchronisation: what issuing it costs) and
then profiles repeated calls with cProfile, printing the functions that take the most time.

  python -m benchmarks.experiments.exp_host --net alexnet --backend auto --calls 200
"""
import argparse
import cProfile
import io
import pstats

from benchmarks.harness import PASSES, Layer, conv_layers, median_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--net", default="alexnet", choices=("alexnet", "overfeat_fast"))
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200, help="calls per pass profiled")
    ap.add_argument("--top", type=int, default=30, help="functions listed")
    args = ap.parse_args()

    import cupy as cp
    calls, rows = [], []
    for name, x_shape, w_shape, stride, padding in conv_layers(args.net, args.batch):
        layer = Layer(x_shape, w_shape, stride, padding, seed=0)
        for p in PASSES:
            fn = layer.dispatched(args.backend, p)
            fn()                                            # tunes (auto), compiles, allocates
            cp.cuda.Device().synchronize()
            # the host clock around each call, the queue drained before it (untimed)
            rows.append((name, p, median_ms(fn, "cpu", 0, 20, before=cp.cuda.Device().synchronize)))
            calls.append(fn)
    print(f"{'layer':8} {'pass':8} host ms per call (issue only, median of 20)")
    for name, p, ms in rows:
        print(f"{name:8} {p:8} {ms:.4f}")
    print(f"total host ms over the network's passes: {sum(ms for *_, ms in rows):.3f}")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.calls):
        for fn in calls:
            fn()
        cp.cuda.Device().synchronize()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()

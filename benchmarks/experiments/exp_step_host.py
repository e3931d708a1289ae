"""Experiment (not a benchmark of record): where a zoo network's eager training step spends its host
time, per precision mode, with the tuning done in this process or read from a cache.

Session 20's AlexNet step in the framework's TF32 mode took 9.76 ms eager against 6.06 as a CUDA
graph, 50 % of it in GPU kernels, where the strict step was 8.38 against 7.36 (76 %). This runs
the step as benchmarks.paper's step does (strict first, its CUDA graph captured and kept, then the
TF32 mode on the same model) and, for each mode, reports:

- the step's median time (CUDA events), the same over five steps back to back, and its issue time
  (the host clock around a step that starts on an idle GPU: as long as the step where the host
  waits for the GPU inside it);
- the device allocations (cudaMalloc through CuPy's pool) a step makes, and the pool's blocks;
- a cProfile of `--profile-steps` steps: the functions with the most own time;
- auto's choices.

Run it twice on one cache: the first run tunes in-process, the second reads every choice.
Session 21 (H100): neither was reliably faster, and the issue time showed the wait that was the
cause: the loss's range check of device targets (b00c402; benchmarks/NOTES.md, session 21).

  MINITORCH_TUNE_CACHE=/tmp/t.json python -m benchmarks.experiments.exp_step_host --net alexnet
  MINITORCH_TUNE_CACHE=/tmp/t.json python -m benchmarks.experiments.exp_step_host --net alexnet
"""
import argparse
import cProfile
import gc
import io
import os
import pstats
import time

from benchmarks.harness import median_ms, pool_misses


def thread_cpu():
    """{thread id: (name, user + system CPU seconds)} of this process's threads (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                text = f.read()
        except OSError:   # the thread ended
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--net", default="alexnet")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--modes", default="strict,tf32", help="comma-separated, run in this order")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25, help="functions listed per profile")
    ap.add_argument("--no-graph", action="store_true", help="skip the strict CUDA graph kept alive")
    ap.add_argument("--no-profile", action="store_true", help="times and allocations only")
    args = ap.parse_args()

    import cupy as cp
    import numpy as np

    import minitorch_fft as mt
    from minitorch_fft import models
    from minitorch_fft.backends import auto, cgemm

    mt.manual_seed(0)
    model = models.get(args.net, num_classes=1000, backend="auto").to("cuda")
    opt = mt.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    crit = mt.CrossEntropyCriterion()
    shape = (args.batch,) + models.input_shape(args.net)
    x = mt.Tensor(cp.asarray(np.random.default_rng(0).standard_normal(shape, dtype=np.float32)))
    y_np = np.random.default_rng(1).integers(0, 1000, args.batch)
    y = cp.asarray(y_np)
    kept, rows = [], []
    pool = cp.get_default_memory_pool()

    for mode in args.modes.split(","):
        tf32 = mode == "tf32"

        def step():
            with cgemm.tf32(tf32):
                mt.train_step(model, crit, opt, x, y)

        t0 = time.perf_counter()
        step()                       # tunes (or reads the cache)
        cp.cuda.Device().synchronize()
        first_s = time.perf_counter() - t0
        for _ in range(2):
            step()
        ms = median_ms(step, "cupy", 1, args.steps)
        issue = median_ms(step, "cpu", 0, args.steps, before=cp.cuda.Device().synchronize)
        burst = median_ms(lambda: [step() for _ in range(5)], "cupy", 1, max(3, args.steps // 5)) / 5
        hook = pool_misses()
        cp.cuda.Device().synchronize()
        with hook:
            for _ in range(3):
                step()
        cp.cuda.Device().synchronize()
        before, wall0, cpu0 = thread_cpu(), time.perf_counter(), time.process_time()
        for _ in range(args.profile_steps):
            step()
        cp.cuda.Device().synchronize()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        after = thread_cpu()
        print(f"=== {args.net} {mode}: {args.profile_steps} steps unprofiled: wall {wall * 1e3:.1f} ms, "
              f"process CPU {cpu * 1e3:.1f} ms; threads that used CPU (ms): "
              + ", ".join(f"{name}[{tid}] {(t - before.get(tid, (name, 0))[1]) * 1e3:.1f}"
                          for tid, (name, t) in sorted(after.items()) if t - before.get(tid, (name, 0))[1] > 0))
        if not args.no_profile:
            with open("/proc/self/statm") as f:
                rss_mib = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
            print(f"=== {args.net} {mode}: Python objects tracked {len(gc.get_objects())}, RSS {rss_mib:.0f} MiB")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.profile_steps):
                step()
            cp.cuda.Device().synchronize()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
            print(f"=== {args.net} {mode}: profile of {args.profile_steps} steps, by own time ===")
            print(text.getvalue())
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(args.top)
            print(f"=== {args.net} {mode}: by cumulative time ===")
            print(text.getvalue())
        rows.append((mode, first_s, ms, burst, issue, len(hook.sizes) / 3, sum(hook.sizes) / 3 / 2**20,
                     pool.n_free_blocks(), pool.total_bytes() / 2**30))
        if mode == "strict" and not args.no_graph:   # as paper.step: the strict graph stays alive
            graphed = mt.graphs.GraphedStep(model, crit, opt)
            for _ in range(2):
                with cgemm.tf32(False):
                    graphed(x, y_np)
            kept.append(graphed)
    print(auto.format_choices())
    print(f"\n{'mode':8}{'first s':>9}{'step ms':>9}{'in 5s ms':>10}{'issue ms':>10}{'mallocs/step':>14}{'MiB/step':>10}"
          f"{'free blocks':>13}{'pool GiB':>10}")
    for mode, first_s, ms, burst, issue, n, mib, free, total in rows:
        print(f"{mode:8}{first_s:9.1f}{ms:9.2f}{burst:10.2f}{issue:10.2f}{n:14.1f}{mib:10.1f}{free:13d}{total:10.2f}")


if __name__ == "__main__":
    main()

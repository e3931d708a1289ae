"""Experiment (not a benchmark of record): does a torch.profiler session leave the process's later
eager steps slower?

benchmarks.paper's step measures each of our rows' share of time in GPU kernels with torch.profiler
(CUPTI) right after timing the row, so every row it times after the first row (our TF32-mode eager
step, PyTorch's strict and TF32 steps) runs after a profiler session. Kineto leaves CUPTI
subscribed when a session ends unless TEARDOWN_CUPTI=1 (pytorch/pytorch#144455: training 10-20 %
slower after profiling), and a subscribed CUPTI adds host time to every launch. ResNet-18's TF32
eager step in paper.step ran at 74.8 % in kernels, 0.88x PyTorch TF32, where exp_step_host (no
profiler) ran the same choices GPU-bound (benchmarks/NOTES.md, session 24).

In one process, per network: our strict and TF32-mode eager steps and PyTorch's strict and
default (TF32) steps, each timed twice (CUDA events, median), then one profiler session as
paper.kernel_fraction runs it, then each timed twice again; a CUDA graph of our strict step is
captured before the session and replayed after it, and a second session profiles that replay (the
teardown's re-initialisation beside a live graph). Run it once as it is and once with
TEARDOWN_CUPTI=1:

  MINITORCH_TUNE_CACHE=/tmp/t.json python -m benchmarks.experiments.exp_profiler_residue --nets alexnet,resnet18
  TEARDOWN_CUPTI=1 MINITORCH_TUNE_CACHE=/tmp/t.json python -m benchmarks.experiments.exp_profiler_residue \\
      --nets alexnet,resnet18 --label TEARDOWN_CUPTI=1
"""
import argparse
import gc

from benchmarks.harness import median_ms, pool_misses, set_tf32, setup_cudnn, torch_model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default="alexnet,resnet18")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per median")
    ap.add_argument("--no-profile", action="store_true", help="no profiler sessions between the rounds")
    ap.add_argument("--label", default="", help="printed above the table (e.g. the TEARDOWN_CUPTI setting)")
    args = ap.parse_args()

    import cupy as cp
    import numpy as np
    import torch

    import minitorch_fft as mt
    from minitorch_fft import models
    from minitorch_fft.backends import cgemm
    from benchmarks.paper import kernel_fraction

    setup_cudnn(torch)   # benchmark mode, full search, PyTorch's TF32 defaults recorded for set_tf32
    print(f"{args.label} torch {torch.__version__}", flush=True)
    table, diag = [], []
    pool = cp.get_default_memory_pool()

    for net in args.nets.split(","):
        shape = (args.batch,) + models.input_shape(net)
        x_np = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
        y_np = np.random.default_rng(1).integers(0, 1000, args.batch)
        mt.manual_seed(0)
        model = models.get(net, num_classes=1000, backend="auto").to("cuda")
        opt = mt.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        crit = mt.CrossEntropyCriterion()
        x, y = mt.Tensor(cp.asarray(x_np)), cp.asarray(y_np)
        tm = torch_model(net, 1000).cuda()
        topt = torch.optim.SGD(tm.parameters(), lr=0.01, momentum=0.9)
        xt, yt = torch.from_numpy(x_np).cuda(), torch.from_numpy(y_np).cuda()

        def ours(tf32):
            def step():
                with cgemm.tf32(tf32):
                    mt.train_step(model, crit, opt, x, y)
            return step

        def theirs(mode):
            def step():
                set_tf32(mode)
                loss = torch.nn.functional.cross_entropy(tm(xt), yt)
                topt.zero_grad()
                loss.backward()
                topt.step()
            return step

        steps = {"ours strict": (ours(False), "cupy"), "ours TF32 mode": (ours(True), "cupy"),
                 "PyTorch strict": (theirs("strict"), "torch"), "PyTorch TF32": (theirs("tf32"), "torch")}
        for fn, _ in steps.values():      # tunes (or reads the cache), warms
            fn()
        graphed = mt.graphs.GraphedStep(model, crit, opt)

        def graph_step():
            with cgemm.tf32(False):
                graphed(x, y_np)
        graph_step()
        graph_step()
        steps["ours strict, CUDA graph"] = (graph_step, "cupy")
        times = {name: [] for name in steps}

        def round_():
            for name, (fn, lib) in steps.items():
                times[name].append(median_ms(fn, lib, 2, args.steps))
                if name.startswith("ours") and "graph" not in name:   # what else the step does
                    issue = median_ms(fn, "cpu", 0, 5, before=cp.cuda.Device().synchronize)
                    hook = pool_misses()
                    with hook:
                        for _ in range(3):
                            fn()
                    cp.cuda.Device().synchronize()
                    diag.append((net, len(times[name]), name, issue, len(hook.sizes) / 3, sum(hook.sizes) / 3 / 2**20,
                                 gc.collect(), pool.total_bytes() / 2**30))
        round_()
        round_()
        frac1 = None if args.no_profile else kernel_fraction(steps["ours strict"][0])
        round_()
        round_()
        frac2 = None if args.no_profile else kernel_fraction(graph_step)
        round_()
        set_tf32("strict")
        if not args.no_profile:
            print(f"{net}: kernel fraction of our strict eager step {frac1:.1%} (first session), of its graph "
                  f"{frac2:.1%} (second)", flush=True)
        for name, t in times.items():
            table.append((net, name, *t))
        del model, opt, graphed, tm, topt
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    print(f"\n{args.label}; ms, median of {args.steps} steps; "
          "sessions: profiler after round 2 (eager strict) and after round 4 (graph)")
    print(f"{'net':10}{'step':26}{'r1':>8}{'r2':>8}{'r3':>8}{'r4':>8}{'r5':>8}{'r3-4/r1-2':>11}")
    for net, name, *t in table:
        ratio = (t[2] + t[3]) / (t[0] + t[1])
        print(f"{net:10}{name:26}" + "".join(f"{v:8.2f}" for v in t) + f"{ratio:11.3f}")
    print(f"\n{'net':10}{'round':>6} {'step':18}{'issue ms':>9}{'mallocs/step':>13}{'MiB/step':>9}"
          f"{'gc found':>9}{'pool GiB':>9}")
    for net, r, name, issue, n, mib, found, gib in diag:
        print(f"{net:10}{r:6d} {name:18}{issue:9.2f}{n:13.1f}{mib:9.1f}{found:9d}{gib:9.2f}")


if __name__ == "__main__":
    main()

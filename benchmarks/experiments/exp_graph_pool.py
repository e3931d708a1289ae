"""Experiment (not a benchmark of record): what fills a CUDA graph's own pool (GraphedStep.pool)?

Once harness.peak_step_bytes counted a graph's pool whole (session 25), paper.step's graph rows
read well over their eager steps' peaks: AlexNet 2.03 against 1.33 GiB, ResNet-18 3.61 against
2.66 (H100, d9c6d52). Per network this reports, in MiB: the eager step's own transient (its peak
less what was in use before it), then, for the capture: the bytes in use in the graph's pool at
its high-water mark (the allocations the captured step holds at once), the pool's size after the
capture (what it took from the device: the high-water mark plus what it could not reuse), its
free blocks, and the number and bytes of the device allocations (cudaMalloc) it made. A second
table follows the default pool: its bytes in use before the eager step and at the graph's replay,
the graph's static input, and what the graph holds of the backends' (scratch buffers and cuFFT
plans, those retired from the caches during the capture among them).

Each network and mode is captured twice on the same model, the graph's memory as the capture asks
(graphs.ARENA off) and from the planned arena (on, session 26), with the captures made and the
host seconds the capturing call took.

  MINITORCH_TUNE_CACHE=/tmp/t.json python -m benchmarks.experiments.exp_graph_pool --nets alexnet,resnet18
"""
import argparse
import json

from benchmarks.harness import peak_step_bytes, pool_misses, pool_peak, write_text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default="alexnet,resnet18")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--arena", default="off,on", help="graphs.ARENA settings to compare, in order")
    ap.add_argument("--dump", metavar="FILE", help="write the blocks each plan was made from ([bytes, start, "
                    "end] per network and mode, JSON) here, to tune the placement offline")
    args = ap.parse_args()

    import time

    import cupy as cp
    import numpy as np

    import minitorch_fft as mt
    from minitorch_fft import models
    from minitorch_fft import backends
    from minitorch_fft.backends import cgemm, cufft_buffers

    mib = 2.0**20
    rows, shares = [], []
    planned, plan_arena = {}, mt.graphs.plan_arena

    def noting_plan_arena(blocks, *rest):     # what each plan was made from, for --dump
        planned[current] = [list(b) for b in blocks]
        return plan_arena(blocks, *rest)
    mt.graphs.plan_arena = noting_plan_arena
    for net in args.nets.split(","):
        for tf32 in (False, True):
            shape = (args.batch,) + models.input_shape(net)
            mt.manual_seed(0)
            model = models.get(net, num_classes=1000, backend="auto").to("cuda")
            opt = mt.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            crit = mt.CrossEntropyCriterion()
            x = mt.Tensor(cp.asarray(np.random.default_rng(0).standard_normal(shape, dtype=np.float32)))
            y_np = np.random.default_rng(1).integers(0, 1000, args.batch)
            y = cp.asarray(y_np)

            def step():
                with cgemm.tf32(tf32):
                    mt.train_step(model, crit, opt, x, y)
            step()
            step()
            cp.cuda.Device().synchronize()
            before = cp.get_default_memory_pool().used_bytes()
            eager = peak_step_bytes(step, "cupy")["peak"] - before
            for arena in args.arena.split(","):
                mt.graphs.ARENA = arena == "on"
                current = f"{net} {'TF32 mode' if tf32 else 'strict'}"
                cufft_buffers.release_buffers()   # each capture starts alike: its eager call rebuilds them
                graphed = mt.graphs.GraphedStep(model, crit, opt)
                with cgemm.tf32(tf32):
                    graphed(x, y_np)                           # eager
                    mallocs = pool_misses()
                    t0 = time.perf_counter()
                    with pool_peak([graphed.pool]) as hook, mallocs:
                        graphed(x, y_np)                       # captures, then replays
                    cp.cuda.Device().synchronize()
                    seconds = time.perf_counter() - t0
                pool = graphed.pool
                arrays = [h for h in graphed._held if isinstance(h, cp.ndarray)]
                plans = [h for h in graphed._held if not isinstance(h, cp.ndarray)]
                work = sum(getattr(getattr(p, "work_area", None), "mem", None).size
                           for p in plans if getattr(p, "work_area", None) is not None)
                label = ("TF32 mode" if tf32 else "strict") + f" {arena}"
                shares.append((net, label, before / mib,
                               cp.get_default_memory_pool().used_bytes() / mib, graphed.x.nbytes / mib,
                               sum(a.nbytes for a in arrays) / mib, len(plans), work / mib,
                               len(graphed._held) - len(backends.held_on_device())))
                plan = graphed.arena_plan or (0, 0)
                rows.append((net, label, eager / mib, hook.peak / mib,
                             pool.total_bytes() / mib, pool.used_bytes() / mib, pool.n_free_blocks(),
                             len(mallocs.sizes), sum(mallocs.sizes) / mib, graphed.records,
                             graphed._arena is not None, plan[0] / mib, seconds,
                             sorted(mallocs.sizes, reverse=True)[:6]))
                print(rows[-1], "plan missed:" if graphed.plan_miss else "", graphed.plan_miss or "", flush=True)
                del graphed
                cp.get_default_memory_pool().free_all_blocks()
            del model, opt, x, y
            cp.get_default_memory_pool().free_all_blocks()
    if args.dump:
        write_text(args.dump, json.dumps(planned))
        print(f"planned blocks: {args.dump}")
    print(f"\n{'net':10}{'mode, arena':15}{'eager MiB':>10}{'capture hw':>11}{'pool MiB':>9}{'used':>8}{'free blk':>9}"
          f"{'mallocs':>8}{'MiB':>8}{'captures':>9}{'planned':>8}{'plan MiB':>9}{'capture s':>10}  largest (MiB)")
    for net, mode, eager, hw, total, used, free, n, nbytes, records, planned, plan, seconds, largest in rows:
        print(f"{net:10}{mode:15}{eager:10.0f}{hw:11.0f}{total:9.0f}{used:8.0f}{free:9d}{n:8d}{nbytes:8.0f}"
              f"{records:9d}{str(planned):>8}{plan:9.0f}{seconds:10.2f}  "
              + " ".join(f"{s / mib:.0f}" for s in largest))
    print(f"\n{'net':10}{'mode, arena':15}{'default before':>15}{'at replay':>10}{'static x':>9}{'held arrays':>12}"
          f"{'plans':>6}{'work MiB':>9}{'retired':>8}")
    for net, mode, before, after, xs, arr, n_plans, work, retired in shares:
        print(f"{net:10}{mode:15}{before:15.0f}{after:10.0f}{xs:9.0f}{arr:12.0f}{n_plans:6d}{work:9.0f}{retired:8d}")


if __name__ == "__main__":
    main()

"""Question: why does AlexNet's gradient all-reduce not overlap backward on two GPUs (bench_ddp:
3 % hidden, where PyTorch DDP hides most of the same 244 MB)? A CUPTI kernel trace (PyTorch's
profiler sees every kernel of the process, CuPy's and NCCL's too) of a few data-parallel steps
per rank: when each NCCL kernel starts and ends against the step's other kernels.

    python -m benchmarks.experiments.exp_ddp_overlap --out $OUT            # 2 ranks, eager
    python -m benchmarks.experiments.exp_ddp_overlap --graphed --out $OUT

Rank 0 prints, per traced step: the step's first and last kernel, each NCCL kernel's start, end
and how much of it ran while a compute kernel ran (overlap), and the compute kernels' busy time.
The traces go to OUT/ddp_trace_rank<r>.json (chrome://tracing)."""
import argparse
import json
import sys
from pathlib import Path



def busy_union(intervals):
    """Total length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def overlap(a, intervals):
    """Length of [a0, a1) covered by the union of intervals."""
    clipped = [(max(s, a[0]), min(e, a[1])) for s, e in intervals if e > a[0] and s < a[1]]
    return busy_union(clipped)


def summarise(trace_path, steps):
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    nccl = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in kernels if "nccl" in e["name"].lower()]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
    lines = [f"{len(kernels)} kernels, {len(nccl)} NCCL"]
    t0 = kernels[0]["ts"] if kernels else 0
    for s, e, name in nccl:
        lines.append(f"  NCCL {name[:40]:40s} start {s - t0:9.1f} us  dur {e - s:8.1f} us  overlapped by compute "
                     f"{overlap((s, e), compute):8.1f} us")
    if kernels:
        end = max(e["ts"] + e["dur"] for e in kernels)
        lines.append(f"  span {end - t0:.1f} us over {steps} steps; compute busy {busy_union(compute):.1f} us; "
                     f"NCCL busy {busy_union([(s, e) for s, e, _ in nccl]):.1f} us")
    return "\n".join(lines)


def worker(args):
    import cupy as cp
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.bench_ddp import make_step, setup_rank
    group, model, opt, crit, x, y, sync = setup_rank(args.net, args.batch, args.backend, 0, "exp_ddp_overlap")
    torch.cuda.set_device(group.rank)
    step = make_step(model, crit, opt, x, y, sync, args.graphed)
    for _ in range(5):
        step()
    cp.cuda.Device().synchronize()
    group.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        cp.cuda.Device().synchronize()
    path = Path(args.out) / f"ddp_trace_rank{group.rank}.json"
    prof.export_chrome_trace(str(path))
    group.barrier()
    if group.rank == 0:
        print(f"{args.net} {'graphed' if args.graphed else 'eager'}, {group.world_size} ranks, buckets "
              f"{[round((b['stop'] - b['start']) * 4 / 2**20, 1) for b in sync.buckets]} MB")
        print(summarise(path, args.steps))
    group.channel.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--net", default="alexnet")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--backend", default="auto")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--graphed", action="store_true")
    p.add_argument("--out", default="/tmp")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    from minitorch_fft import distributed
    return distributed.spawn(args.gpus, [sys.executable, "-m", "benchmarks.experiments.exp_ddp_overlap", "--worker",
                                         *sys.argv[1:]], prog="exp_ddp_overlap")


if __name__ == "__main__":
    sys.exit(main())

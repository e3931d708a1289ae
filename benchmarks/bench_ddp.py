"""Data-parallel training throughput: minitorch-fft over NCCL beside PyTorch DDP (issue #20).

    python -m benchmarks.bench_ddp                              # 1, 2, 4, 8 GPUs (those visible)
    python -m benchmarks.bench_ddp --gpus 1 --quick --backend gemm --nets alexnet --out $OUT

For each GPU count N, network and implementation, N processes (minitorch_fft.distributed.spawn,
NCCL_NVLS_ENABLE=0 in each) train on synthetic ImageNet-sized batches of --batch images per GPU;
rank 0 reports images/s over all GPUs (N * batch * steps / the time of the timed steps, a device
sync and a barrier at both ends). Implementations: minitorch eager, minitorch CUDA graph (the
all-reduce captured in the step's graph), PyTorch DistributedDataParallel with cuDNN strict fp32
(benchmark mode, every algorithm searched: harness.setup_cudnn) and the same per-GPU batch.

Columns: scaling efficiency = images/s over N times the same implementation's 1-GPU images/s;
vs DDP = over PyTorch DDP strict's images/s at the same N. For minitorch: all-reduce ms (the
buckets' all-reduce (ncclAvg, the mean) alone, on an idle GPU), exposed ms (step time with the
gradient sync minus without it) and hidden = 1 - exposed / all-reduce, the share of the
all-reduce that overlapped with backward (with one GPU NCCL only copies, so these say little).

Targets (the issue's): scaling efficiency >= 90 % at the largest N lent; >= 1.3x DDP strict on
AlexNet. The rows for N > 1 need a multi-GPU machine kind (nvidia-h100-x2/-x4,
nvidia-h200-x2/-x4/-x8). A network not in the zoo is skipped with a note.
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import RESULTS_DIR, provenance, set_tf32, setup_cudnn, write_results

IMPLEMENTATIONS = ("minitorch eager", "minitorch CUDA graph", "PyTorch DDP cuDNN strict")
BATCH = 128
NETS = "alexnet,resnet50"


# -- one rank ------------------------------------------------------------------------------------

def _timed(step, steps, barrier, sync_device):
    """Seconds of `steps` calls of step(), between two barriers (rank 0's clock)."""
    sync_device()
    barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync_device()
    barrier()
    return time.perf_counter() - t0


def setup_rank(net, batch, backend, seed, prog):
    """This rank's group and a model on its GPU with rank 0's weights, SGD, the criterion, one
    random batch (x on the GPU, y on the host; different on every rank) and its GradientSync."""
    import cupy as cp

    import minitorch_fft as mt
    from minitorch_fft import models
    from minitorch_fft.backends import cgemm
    from minitorch_fft import distributed
    group = distributed.init_process_group(distributed.launched(), "nccl", prog=prog)
    cgemm.set_tf32(False)                 # strict fp32, as the PyTorch rows
    mt.manual_seed(seed)
    model = models.get(net, num_classes=1000, backend=backend).to("cuda")
    group.broadcast_arrays(distributed.model_state_arrays(model))
    opt = mt.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rng = np.random.default_rng(seed + group.rank)
    x = cp.asarray(rng.standard_normal((batch,) + models.input_shape(net), dtype=np.float32))
    y = rng.integers(0, 1000, batch)
    return group, model, opt, mt.CrossEntropyCriterion(), x, y, distributed.GradientSync(model.parameters(), group)


def make_step(model, crit, opt, x, y, sync, graphed):
    """One training step as a function of nothing: a GraphedStep's replay, or eager."""
    import cupy as cp

    import minitorch_fft as mt
    if graphed:
        g = mt.graphs.GraphedStep(model, crit, opt, sync=sync)
        return lambda: g(x, y)
    xt, yt = mt.Tensor(x), cp.asarray(y)
    return lambda: mt.train_step(model, crit, opt, xt, yt, sync=sync)


def worker_minitorch(net, graphed, batch, backend, warmup, steps, seed):
    import cupy as cp
    group, model, opt, crit, x, y, sync = setup_rank(net, batch, backend, seed, "bench_ddp")
    results = {}
    for with_sync in (False, True):       # without: the local step, to see what the sync adds
        step = make_step(model, crit, opt, x, y, sync if with_sync else None, graphed)
        for _ in range(warmup):
            step()
        results[with_sync] = _timed(step, steps, group.barrier, cp.cuda.Device().synchronize)
    # the all-reduce alone, on an idle GPU: begin() then finish() with no backward between
    # issues every bucket (each .grad is already its view, so nothing is zeroed)
    times = []
    for _ in range(max(3, steps // 2)):
        group.barrier()
        t0 = time.perf_counter()
        sync.begin()
        sync.finish()
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    group.barrier()
    step_s, local_s = results[True] / steps, results[False] / steps
    allreduce_s = statistics.median(times)
    exposed = max(0.0, step_s - local_s)
    group.channel.close()
    return {"images_per_s": group.world_size * batch / step_s, "step_ms": step_s * 1e3,
            "allreduce_ms": allreduce_s * 1e3, "exposed_ms": exposed * 1e3,
            "hidden": max(0.0, 1 - exposed / allreduce_s) if allreduce_s > 0 else None,
            "buckets": len(sync.buckets)}, group.rank


def worker_torch(net, batch, warmup, steps, seed):
    import torch
    import torch.distributed as dist
    import torchvision
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks.harness import torch_model
    from minitorch_fft import distributed
    launch = distributed.launched()
    torch.cuda.set_device(launch.local_rank)
    dist.init_process_group("nccl", rank=launch.rank, world_size=launch.world_size)   # env:// address
    setup_cudnn(torch)
    set_tf32("strict")
    torch.manual_seed(seed)
    tm = (torchvision.models.resnet50(num_classes=1000) if net == "resnet50" else torch_model(net, 1000)).cuda()
    model = DistributedDataParallel(tm, device_ids=[launch.local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(seed + launch.rank)
    shape = (3, 224, 224) if net in ("alexnet", "resnet50") else (3, 231, 231)
    x = torch.randn((batch,) + shape, generator=g).cuda()
    y = torch.randint(0, 1000, (batch,), generator=g).cuda()

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for _ in range(warmup):
        step()
    seconds = _timed(step, steps, dist.barrier, torch.cuda.synchronize)
    dist.destroy_process_group()
    return {"images_per_s": launch.world_size * batch * steps / seconds, "step_ms": seconds / steps * 1e3}, launch.rank


def worker(args):
    if args.impl.startswith("PyTorch"):
        row, rank = worker_torch(args.net, args.batch, args.warmup, args.steps, args.seed)
    else:
        row, rank = worker_minitorch(args.net, args.impl.endswith("graph"), args.batch, args.backend,
                                     args.warmup, args.steps, args.seed)
    if rank == 0:
        Path(args.result).write_text(json.dumps(row))


# -- the driver ----------------------------------------------------------------------------------

def run_one(args, n, net, impl, folder):
    from minitorch_fft import distributed
    result = Path(folder) / "row.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.bench_ddp", "--worker", "--net", net, "--impl", impl, "--batch", str(args.batch),
           "--backend", args.backend, "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--seed", str(args.seed), "--result", str(result)]
    code = distributed.spawn(n, cmd, prog="bench_ddp")
    if code != 0 or not result.exists():
        return {"error": f"exit status {code}"}
    return json.loads(result.read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--gpus", default="1,2,4,8", help="GPU counts, comma-separated (those above the visible skipped)")
    p.add_argument("--nets", default=NETS, help=f"networks, comma-separated (default {NETS}); others than the "
                   "default write bench_ddp_<nets>.md")
    p.add_argument("--batch", type=int, default=BATCH, help="images per GPU")
    p.add_argument("--backend", default="auto", help="minitorch's convolution backend")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="warm-up 2, 5 timed steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--net", help=argparse.SUPPRESS)
    p.add_argument("--impl", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.warmup, args.steps = 2, 5
    import cupy as cp
    import torch

    from minitorch_fft import models
    from minitorch_fft.backends import tuning
    from minitorch_fft import distributed
    visible = distributed.visible_gpus()
    counts = [n for n in map(int, args.gpus.split(",")) if n <= visible]
    nets, notes = [], []
    for net in args.nets.split(","):
        if net in models.names():
            nets.append(net)
        else:
            notes.append(f"{net}: not in the zoo on this commit (models.names(): {', '.join(models.names())}); skipped")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_ddp") as folder:
        for net in nets:
            for impl in IMPLEMENTATIONS:
                for n in counts:
                    row = {"network": net, "implementation": impl, "gpus": n, "batch_per_gpu": args.batch,
                           **run_one(args, n, net, impl, folder)}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    by = {(r["network"], r["implementation"], r["gpus"]): r for r in rows}
    for r in rows:
        one = by.get((r["network"], r["implementation"], 1), {})
        ddp = by.get((r["network"], IMPLEMENTATIONS[2], r["gpus"]), {})
        if "images_per_s" in r and "images_per_s" in one:
            r["scaling"] = r["images_per_s"] / (r["gpus"] * one["images_per_s"])
        if "images_per_s" in r and "images_per_s" in ddp:
            r["vs_ddp"] = r["images_per_s"] / ddp["images_per_s"]
    meta = provenance(tuning.device_name(cp), torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                      nccl=distributed.nccl_version(), visible_gpus=visible, backend=args.backend,
                      warmup=args.warmup, steps=args.steps)
    cols = [("network", "network", ""), ("implementation", "implementation", ""), ("GPUs", "gpus", "d"),
            ("batch/GPU", "batch_per_gpu", "d"), ("step ms", "step_ms", ".2f"), ("images/s", "images_per_s", ".0f"),
            ("scaling", "scaling", ".1%"), ("vs DDP strict", "vs_ddp", ".2f"), ("all-reduce ms", "allreduce_ms", ".2f"),
            ("exposed ms", "exposed_ms", ".2f"), ("hidden", "hidden", ".0%"), ("error", "error", "")]
    name = "bench_ddp" if args.nets == NETS else "bench_ddp_" + "_".join(nets)   # one file per call's networks
    paths = write_results(name, meta, rows, cols, f"Data-parallel training, {meta['device']}",
                          notes="\n".join(["Images/s over all GPUs; module docstring of benchmarks/bench_ddp.py "
                                           "says what each column is."] + notes), out_dir=args.out)
    print(Path(paths[1]).read_text())


if __name__ == "__main__":
    sys.exit(main())

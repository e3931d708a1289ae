"""The eager training step (mt.train_step: forward, backward, SGD) of zoo networks on the GPU,
timed with CUDA events around each step: fresh random data before each (untimed), warm-up
steps first, the median of the timed ones. Run it with PYTHONPATH at the tree to measure, so
two trees (before and after a change) are timed by the same script in one session:

    PYTHONPATH=. python benchmarks/experiments/exp_fused_step.py resnet50:64 alexnet:128
    PYTHONPATH=/path/to/other/tree python benchmarks/experiments/exp_fused_step.py alexnet:128

Prints one JSON line per network: model, batch, backend, median and min ms, steps, the tree.
"""
import argparse
import json
import statistics

import cupy as cp
import numpy as np

import minitorch_fft as mt
try:
    from minitorch_fft import models
except ImportError:   # a tree from before session 52 (gpu_fused.sh's BEFORE_TREE): a top-level package
    import models

WARMUP, STEPS = 3, 10


def time_step(name, batch, backend, warmup=WARMUP, steps=STEPS):
    """(median ms, min ms) of `steps` eager training steps of zoo network `name`."""
    mt.manual_seed(0)
    model = models.get(name, num_classes=1000, backend=backend).to("cuda")
    opt = mt.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    crit = mt.CrossEntropyCriterion()
    shape = (batch,) + tuple(models.input_shape(name))
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for i in range(warmup + steps):
        x = cp.random.standard_normal(shape, dtype=np.float32)   # fresh data, outside the timing
        y = cp.random.randint(0, 1000, batch)
        cp.cuda.Device().synchronize()
        start.record()
        mt.train_step(model, crit, opt, mt.Tensor(x), y)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times), min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("nets", nargs="+", help="name:batch, e.g. resnet50:64")
    ap.add_argument("--backend", default="gemm")
    ap.add_argument("--tree", default=mt.__file__.rsplit("/minitorch_fft/", 1)[0])
    args = ap.parse_args()
    for spec in args.nets:
        name, batch = spec.split(":")
        med, best = time_step(name, int(batch), args.backend)
        print(json.dumps(dict(model=name, batch=int(batch), backend=args.backend, median_ms=round(med, 3),
                              min_ms=round(best, 3), steps=STEPS, tree=args.tree)), flush=True)


if __name__ == "__main__":
    main()

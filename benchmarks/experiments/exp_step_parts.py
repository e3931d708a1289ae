"""Experiment: AlexNet's training step as one CUDA graph, and the core kernels it runs apart from
the convolutions (the SGD update, max pooling forward and backward, dropout), each the median of
30 CUDA-event timings after 3 warm-up runs; then auto's choices.

Written to compare two trees side by side on one GPU: it uses only names that the tree before the
structural refactor (63814cf: backends.autotune) and the tree after it (backends.auto) both have.

  PYTHONPATH=. python3 benchmarks/experiments/exp_step_parts.py          # this tree
  PYTHONPATH=OLD python3 benchmarks/experiments/exp_step_parts.py        # a checkout of another

Results: results/nvidia-h100-80gb-hbm3/structure_ab/step_parts_*.log (benchmarks/NOTES.md, session 8).
"""
import cupy as cp
import numpy as np

from minitorch_fft import backends
import minitorch_fft as mt
import minitorch_fft.functional as F
from minitorch_fft import models

tuner = getattr(backends, "auto", None) or backends.autotune


def med(fn, n=30):
    for _ in range(3):
        fn()
    s, e, ts = cp.cuda.Event(), cp.cuda.Event(), []
    for _ in range(n):
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e))
    return float(np.median(ts))


mt.manual_seed(0)
model = models.get("alexnet", num_classes=1000, backend="auto").to("cuda")
opt = mt.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
crit = mt.CrossEntropyCriterion()
x = cp.asarray(np.random.default_rng(0).standard_normal((128, 3, 224, 224), dtype=np.float32))
y = np.random.default_rng(1).integers(0, 1000, 128)
g = mt.graphs.GraphedStep(model, crit, opt)
graph = med(lambda: g(x, y))
sgd = med(opt.step)
a = mt.Tensor(cp.random.standard_normal((128, 64, 55, 55), dtype=np.float32), requires_grad=True)  # conv1's output
pool_fwd = med(lambda: F.max_pool2d(a, 3, 2))
o = F.max_pool2d(a, 3, 2)
gy = cp.random.standard_normal(o.shape, dtype=np.float32)
pool_bwd = med(lambda: o._ctx.backward(gy))
d = mt.Tensor(cp.random.standard_normal((128, 4096), dtype=np.float32))              # fc6's output
drop = med(lambda: F.dropout(d, 0.5, True))
print(f"RESULT graph_step_ms {graph:.3f} sgd_ms {sgd:.3f} pool_fwd_ms {pool_fwd:.3f} pool_bwd_ms {pool_bwd:.3f} "
      f"dropout_ms {drop:.4f}")
print(tuner.format_choices())

"""session 15: gemm's accGrad kernels for the 3-plane first layers, each launched once on VGG-16 conv1_1
(b64) and ResNet's conv1 (b128), for Nsight Compute's counters (instructions, FMA pipe, shared
wavefronts, issue activity, warp stalls):

  PYTHONPATH=. ncu -k regex:accgrad_ --metrics smsp__inst_executed.sum,smsp__inst_executed_pipe_fma.sum,... \\
      --section WarpStateStats python3 benchmarks/experiments/ncu_accgrad_forms.py [implicit implicit8 rows]

The session's ncu logs (results/<device>/experiments/ncu_accgrad_*.txt) came from two .dev scripts
that did the same for the implicit forms and for the rows form."""
import sys
import cupy as cp
from minitorch_fft.backends import gemm
from minitorch_fft.backends.common import geometry
forms = sys.argv[1:] or ["implicit", "implicit8", "rows"]
for xs, ws, s, p in (((64, 3, 224, 224), (64, 3, 3, 3), (1, 1), (1, 1)), ((128, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3))):
    g = geometry(xs, ws, s, p)
    x = cp.random.standard_normal(xs, dtype=cp.float32); gy = cp.random.standard_normal((g.S, g.fo, g.oh, g.ow), dtype=cp.float32)
    for form in forms:
        if form == "rows":
            gemm._accgrad_rows(cp, gy, x, g)
        else:
            gemm._accgrad_implicit(cp, gy, x, g, form)
        cp.cuda.Device().synchronize()

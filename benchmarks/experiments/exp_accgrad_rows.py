"""session 15: gemm's rows accGrad form (kernels/im2col.cu accgrad_rows_*: tiles of one output row, a
window of kernel taps sliding along it in registers) beside the implicit forms, the per-image
products and cuDNN strict, on the zoo's 3-plane first layers. For each: the plan (block, tile,
registers), every form's error against float64 (PyTorch's weight gradient in float64) and its time
(median of CUDA events), its effective TFLOP/s (2*f'*f*kh*kw*S*oh*ow over the time), and the
partial gradients' sum by CuPy's axis-0 reduction against sum_rows.

  PYTHONPATH=. python3 benchmarks/experiments/exp_accgrad_rows.py out.json"""
import json
import sys
import cupy as cp, torch
from minitorch_fft.backends import gemm
from minitorch_fft.backends.common import geometry
from benchmarks.harness import median_ms, setup_cudnn, set_tf32
setup_cudnn(torch); set_tf32("strict")
LAYERS = (("vgg16 conv1_1", (64, 3, 224, 224), (64, 3, 3, 3), (1, 1), (1, 1)),
          ("resnet conv1", (128, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3)),
          ("alexnet conv1", (128, 3, 224, 224), (64, 3, 11, 11), (4, 4), (2, 2)))
rows = []
for name, xs, ws, s, p in LAYERS:
    g = geometry(xs, ws, s, p)
    x = cp.random.standard_normal(xs, dtype=cp.float32); gy = cp.random.standard_normal((g.S, g.fo, g.oh, g.ow), dtype=cp.float32)
    xt, gyt = torch.from_dlpack(x).double(), torch.from_dlpack(gy).double()
    ref = torch.ops.aten.convolution_backward(gyt, xt, torch.zeros(ws, dtype=torch.float64, device="cuda"), None, list(s), list(p),
                                              [1, 1], False, [0, 0], 1, [False, True, False])[1]
    ref = cp.asarray(ref.reshape(g.fo, -1)); scale = float(cp.abs(ref).max())
    flops = 2.0 * g.fo * g.f * g.kh * g.kw * g.S * g.oh * g.ow
    plan = gemm._rows_plan(g, cp)
    kname = plan[0]
    kern = gemm.cuda_module("im2col.cu").get_function(kname)
    r = dict(layer=name, geom=f"{g.f}->{g.fo} {g.h}x{g.w} k{g.kh} s{g.sh} b{g.S}",
             plan=dict(kernel=kname, threads_a_group=plan[1], groups=plan[2], tp=plan[3], tiles_row=plan[4], smem=plan[5],
                       registers=kern.num_regs, resident=gemm._resident_blocks(kern, plan[1] * plan[2], plan[5])))
    forms = {"per_image": lambda: gemm.accgrad(gy, x, ws, s, p)}
    for f in gemm.IMPLICIT:
        if gemm._implicit_fits(g, f):
            forms[f] = (lambda f=f: gemm._accgrad_implicit(cp, gy, x, g, f))
    forms["rows"] = lambda: gemm._accgrad_rows(cp, gy, x, g)
    orig = gemm._form
    gemm._form = lambda xp, pass_name, g, run, forms=None: "per_image"
    for f, fn in forms.items():
        out = fn().reshape(g.fo, -1)
        r[f + "_err"] = float(cp.abs(out - ref).max()) / scale
        r[f + "_ms"] = median_ms(fn, "cupy")
    gemm._form = orig
    wt = torch.zeros(ws, dtype=torch.float32, device="cuda")
    xt32, gyt32 = torch.from_dlpack(x), torch.from_dlpack(gy)
    r["cudnn_ms"] = median_ms(lambda: torch.ops.aten.convolution_backward(gyt32, xt32, wt, None, list(s), list(p), [1, 1], False,
                                                                          [0, 0], 1, [False, True, False]), "torch")
    part = cp.random.standard_normal((plan[2] * 1188, g.fo * g.f * g.kh * g.kw), dtype=cp.float32)
    r["sum_cupy_ms"] = median_ms(lambda: part.sum(axis=0), "cupy")
    r["sum_rows_ms"] = median_ms(lambda: gemm._sum_rows(cp, part), "cupy")
    r["sum_rows_err"] = float(cp.abs(gemm._sum_rows(cp, part) - part.astype(cp.float64).sum(axis=0)).max())
    rows.append(r)
    print(f"{name:14} {r['geom']:26} plan {r['plan']}", flush=True)
    print("   " + "  ".join(f"{f} {r[f + '_ms']:.3f} ms ({flops / r[f + '_ms'] / 1e9:.1f} TF/s, err {r[f + '_err']:.1e})" for f in forms)
          + f"  cudnn {r['cudnn_ms']:.3f} ({flops / r['cudnn_ms'] / 1e9:.1f} TF/s)", flush=True)
    print(f"   partials {part.shape}: cupy sum {r['sum_cupy_ms']:.4f} ms, sum_rows {r['sum_rows_ms']:.4f} ms (err {r['sum_rows_err']:.1e})", flush=True)
    del x, gy, xt, gyt, ref, part; cp.get_default_memory_pool().free_all_blocks(); torch.cuda.empty_cache()
json.dump(rows, open(sys.argv[1], "w"), indent=1)

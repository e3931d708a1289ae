"""session 14: gemm's im2col/col2im, three kernels side by side, outputs compared exactly: the element-
per-thread form before session 14 ("old", im2col_s14/im2col_element.cu, a42914b), one row per block
("rows", im2col_s14/im2col_rows.cu, a26d51f) and the (positions, taps, images) grid ("new",
minitorch_fft/backends/kernels/im2col.cu); with the fprop's parts (the GEMM, the transpose into y) and whole gemm
passes beside cuDNN strict.

  PYTHONPATH=. python3 benchmarks/experiments/exp_im2col.py out.json"""
import json
import sys
from pathlib import Path
import cupy as cp, torch
from minitorch_fft.backends import gemm, cgemm
from minitorch_fft.backends.common import geometry, launch_1d, sm_count
from benchmarks.harness import median_ms, setup_cudnn, set_tf32
setup_cudnn(torch); set_tf32("strict")
HERE = Path(__file__).resolve().parent / "im2col_s14"
KERNEL = Path(__file__).resolve().parents[2] / "minitorch_fft" / "backends" / "kernels" / "im2col.cu"
mods = {v: cp.RawModule(code=open(f).read(), options=("--std=c++17",)) for v, f in
        (("old", HERE / "im2col_element.cu"), ("rows", HERE / "im2col_rows.cu"), ("new", KERNEL))}
def rows_launch(kernel, rows, row_len, args):
    passes = -(-row_len // 256); block = 32 * -(-row_len // (32 * passes))
    kernel((int(min(rows, sm_count(0) * 32)),), (block,), args)
def im2col(v, name, x, cols, g, n, K, P):
    a = (x, cols) + gemm._int32_args(g, n); k = mods[v].get_function(name)
    if v == "old": return lambda: launch_1d(k, cols.size, a)
    if v == "rows": return lambda: rows_launch(k, n * K, P, a)
    return lambda: gemm._launch_planes(k, P, K, n, a)
def col2im(v, cols, gx, g, n):
    a = (cols, gx) + gemm._int32_args(g, n); k = mods[v].get_function("col2im")
    if v == "old": return lambda: launch_1d(k, gx.size, a)
    if v == "rows": return lambda: rows_launch(k, n * g.f, g.h * g.w, a)
    return lambda: gemm._launch_planes(k, g.h * g.w, g.f, n, a)
L = [("r50 conv13 128->128 56 s2", (128, 128, 56, 56), (128, 128, 3, 3), (2, 2), (1, 1)),
     ("r50 conv1 7x7 s2", (128, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3)),
     ("r18 l2.0.c1 64->128 56 s2", (128, 64, 56, 56), (128, 64, 3, 3), (2, 2), (1, 1)),
     ("r50 l3 256->256 28 s2", (128, 256, 28, 28), (256, 256, 3, 3), (2, 2), (1, 1)),
     ("r50 l4 512->512 14 s2", (128, 512, 14, 14), (512, 512, 3, 3), (2, 2), (1, 1)),
     ("vgg conv1_1 3->64 224", (64, 3, 224, 224), (64, 3, 3, 3), (1, 1), (1, 1)),
     ("vgg conv3_2 256 56", (64, 256, 56, 56), (256, 256, 3, 3), (1, 1), (1, 1)),
     ("r18 3x3 512 7", (128, 512, 7, 7), (512, 512, 3, 3), (1, 1), (1, 1)),
     ("odd 5x3 s(2,1) p(2,0) b3", (3, 4, 10, 12), (6, 4, 5, 3), (2, 1), (2, 0))]
rows = []
for name, xs, ws, s, pd in L:
    g = geometry(xs, ws, s, pd); K, P = g.f * g.kh * g.kw, g.oh * g.ow
    n = min(g.S, max(1, (512 << 20) // ((K + g.fo) * P * 4)))
    x = cp.ascontiguousarray(cp.random.standard_normal(xs, dtype=cp.float32)[:n])
    w = cp.random.standard_normal(ws, dtype=cp.float32); w2 = w.reshape(g.fo, -1)
    gy = cp.random.standard_normal((g.S, g.fo, g.oh, g.ow), dtype=cp.float32)
    r = dict(layer=name, n=n)
    for layout, kname, shape in (("flat", "im2col", (K, n * P)), ("img", "im2col_images", (n, K, P))):
        outs = {}
        for v in mods:
            outs[v] = cp.full(shape, cp.nan, cp.float32); f = im2col(v, kname, x, outs[v], g, n, K, P); f()
            r[f"{layout}_{v}"] = median_ms(f, "cupy")
        r[f"{layout}_same"] = all(bool((outs[v] == outs["old"]).all()) for v in mods)
        if layout == "flat": c_new = outs["new"]
        del outs
    r["gemm"] = median_ms(lambda: cgemm.matmul(cp, w2, c_new, strict=True), "cupy")
    yc = cgemm.matmul(cp, w2, c_new, strict=True); y = cp.empty((n, g.fo, g.oh, g.ow), cp.float32)
    def tr(): y[...] = yc.reshape(g.fo, n, g.oh, g.ow).transpose(1, 0, 2, 3)
    r["transpose"] = median_ms(tr, "cupy")
    del c_new, yc, y
    cols = cgemm.matmul(cp, w2, gemm._flat(gy[:n]), op_a="T", strict=True)
    gxs = {}
    for v in mods:
        gxs[v] = cp.full((n, g.f, g.h, g.w), cp.nan, cp.float32); f = col2im(v, cols, gxs[v], g, n); f()
        r[f"col2im_{v}"] = median_ms(f, "cupy")
    r["col2im_same"] = all(bool((gxs[v] == gxs["old"]).all()) for v in mods)
    del gxs, cols
    xf = cp.random.standard_normal(xs, dtype=cp.float32)
    r["fprop"] = median_ms(lambda: gemm.fprop(xf, w, s, pd), "cupy")
    r["bprop"] = median_ms(lambda: gemm.bprop(gy, w, xs, s, pd), "cupy")
    xt, wt, gyt = (torch.from_dlpack(v) for v in (xf, w, gy))
    r["cudnn_fprop"] = median_ms(lambda: torch.nn.functional.conv2d(xt, wt, stride=s, padding=pd), "torch")
    r["cudnn_bprop"] = median_ms(lambda: torch.ops.aten.convolution_backward(gyt, xt, wt, None, list(s), list(pd), [1, 1], False, [0, 0], 1, [True, False, False]), "torch")
    rows.append(r)
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    del x, w, gy, xf, xt, wt, gyt; cp.get_default_memory_pool().free_all_blocks()
json.dump(rows, open(sys.argv[1], "w"), indent=1)

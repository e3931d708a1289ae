"""session 13 diagnosis: gemm's 1x1 'now' ran 40-60% slower in exp_gemm_1x1 at 1292016 than at
4197e11 while cuDNN ran 7% slower. Per layer and pass: forced per_image, forced flat, untuned rule,
tuned (with the record), cuDNN strict; plus the accGrad forms (per-image, flat, and since session 14
the implicit ones, kernels/im2col.cu accgrad_small; since session 15 the rows form, accgrad_rows_*)
on 3-plane first layers.

  PYTHONPATH=. MINITORCH_TUNE_CACHE=<a tuned cache> python3 benchmarks/experiments/exp_gemm_forms.py out.json"""
import json
import sys
import cupy as cp, torch
from minitorch_fft.backends import gemm, tuning, config
from minitorch_fft.backends.common import geometry
from benchmarks.harness import distinct_conv_layers, median_ms, setup_cudnn, set_tf32
setup_cudnn(torch); set_tf32("strict")
a = cp.zeros((4, 8, 6, 6), cp.float32)
print("x[:,:,::1,::1] c_contiguous:", a[:, :, ::1, ::1].flags.c_contiguous)
orig = gemm._form
def forced(form):
    return lambda xp, pass_name, g, run, forms=None: form
def call(p, x, w, gy, s, pd):
    if p == "fprop": return gemm.fprop(x, w, s, pd)
    if p == "bprop": return gemm.bprop(gy, w, x.shape, s, pd)
    return gemm.accgrad(gy, x, w.shape, s, pd)
def cud(p, x, w, gy, s, pd):
    xt, wt, gyt = (torch.from_dlpack(v) for v in (x, w, gy))
    if p == "fprop": return lambda: torch.nn.functional.conv2d(xt, wt, stride=s, padding=pd)
    m = [p == "bprop", p == "accgrad", False]
    return lambda: torch.ops.aten.convolution_backward(gyt, xt, wt, None, list(s), list(pd), [1, 1], False, [0, 0], 1, m)
rows = []
layers = [("resnet50", l) for l in distinct_conv_layers("resnet50", 128) if l[2][2:] == (1, 1)][:8]
layers += [("resnet18", l) for l in distinct_conv_layers("resnet18", 128) if l[2][2:] == (1, 1)]
layers += [("vgg16", distinct_conv_layers("vgg16", 64)[0]), ("resnet50", distinct_conv_layers("resnet50", 128)[0])]
for net, (name, xs, ws, s, pd, count) in layers:
    g = geometry(xs, ws, s, pd)
    x = cp.random.standard_normal(xs, dtype=cp.float32); w = cp.random.standard_normal(ws, dtype=cp.float32)
    gy = cp.random.standard_normal((g.S, g.fo, g.oh, g.ow), dtype=cp.float32)
    passes = ("fprop", "bprop", "accgrad") if ws[2:] == (1, 1) else ("accgrad",)
    for p in passes:
        r = dict(net=net, layer=name, geom=f"{g.f}->{g.fo} {g.h}x{g.w} k{g.kh} s{g.sh}", p=p)
        forms = ["per_image", "flat"] + [f for f in gemm.IMPLICIT if p == "accgrad" and ws[2:] != (1, 1) and gemm._implicit_fits(g, f)]
        forms += ["rows"] if p == "accgrad" and gemm._rows_plan(g, cp) else []
        for label in forms:
            gemm._form = forced(label)
            r[label] = median_ms(lambda: call(p, x, w, gy, s, pd), "cupy")
        gemm._form = orig
        with config.override(gemm_tune="off"):
            r["rule"] = median_ms(lambda: call(p, x, w, gy, s, pd), "cupy")
        with config.override(gemm_tune="on"):
            call(p, x, w, gy, s, pd)
            r["tuned"] = median_ms(lambda: call(p, x, w, gy, s, pd), "cupy")
            rec = tuning.default_cache().get(gemm.form_key(cp, p, g))
        r["choice"] = rec and rec["choice"]; r["rec_ms"] = rec and rec["ms"]
        r["cudnn"] = median_ms(cud(p, x, w, gy, s, pd), "torch")
        rows.append(r)
        implicit = "".join(f" {f} {r[f]:.3f}" for f in tuple(gemm.IMPLICIT) + ("rows",) if f in r)
        print(f"{net:8} {name:7} {r['geom']:22} {p:8} per_image {r['per_image']:.3f} flat {r['flat']:.3f}{implicit} rule {r['rule']:.3f} "
              f"tuned {r['tuned']:.3f} ({r['choice']}; {r['rec_ms']}) cudnn {r['cudnn']:.3f}", flush=True)
    del x, w, gy; cp.get_default_memory_pool().free_all_blocks()
json.dump(rows, open(sys.argv[1], "w"), indent=1)

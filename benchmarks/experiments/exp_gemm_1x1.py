"""Experiment: the gemm backend's 1x1 bprop and accGrad against other GEMM formulations and cuDNN.

Session 12's table3 (H100, 968041d) put ResNet-50's 1x1 layers' bprop and accGrad at up to half
cuDNN strict's speed where fprop, the same FLOPs, is at par (64->256 at 56x56, b128: fprop 0.53,
bprop 0.92, accGrad 1.19 ms against cuDNN's 0.50 / 0.48 / 0.65). The question: is it the GEMM's
form (cuBLAS's kernel for a transposed, broadcast W; many small per-image products), so that
another form of the same GEMM wins, or something a GEMM cannot reach? Forms timed, each checked
against PyTorch float64:

  bprop    now   W^T @ gy_s, W broadcast, op T (gemm._bprop_1x1)
           wT    the same with W^T made contiguous first (op N; W is tiny)
  accGrad  now   gemm._accgrad_1x1 (per-image (f', f) products summed, or one GEMM on copies)
           xg    per-image products the other way round, x_s @ gy_s^T -> (f, f'), summed
           cat   gy and x transposed to (f', S*P) and (f, S*P), one GEMM
Strided 1x1 layers are timed in their current form only, beside cuDNN.

  PYTHONPATH=. python3 benchmarks/experiments/exp_gemm_1x1.py --net resnet50 --batch 128
"""
import argparse
import json

import numpy as np

from benchmarks.harness import distinct_conv_layers, median_ms, reference64, rel_error, setup_cudnn, set_tf32


def _forms(cp, gemm, cgemm, g):
    """{(pass, form): fn(x, w, gy) -> result}."""
    P = g.oh * g.ow

    def bprop_wt(x, w, gy):
        w2t = cp.ascontiguousarray(w.reshape(g.fo, g.f).T)           # (f, f')
        gx = cp.empty((g.S, g.f, g.h, g.w), cp.float32)
        cgemm.matmul(cp, w2t, gy.reshape(g.S, g.fo, P), out=gx.reshape(g.S, g.f, P), strict=True)
        return gx

    def accgrad_xg(x, w, gy):
        parts = cgemm.matmul(cp, x.reshape(g.S, g.f, P), gy.reshape(g.S, g.fo, P), op_b="T", strict=True)
        return parts.sum(axis=0).T.reshape(g.fo, g.f, 1, 1)         # (f, f') summed -> (f', f)

    def accgrad_cat(x, w, gy):
        a = gy.reshape(g.S, g.fo, P).transpose(1, 0, 2).reshape(g.fo, g.S * P)   # copies
        b = x.reshape(g.S, g.f, P).transpose(1, 0, 2).reshape(g.f, g.S * P)
        return cgemm.matmul(cp, a, b, op_b="T", strict=True).reshape(g.fo, g.f, 1, 1)

    forms = {("fprop", "now"): lambda x, w, gy: gemm.fprop(x, w, (g.sh, g.sw), (g.ph, g.pw)),
             ("bprop", "now"): lambda x, w, gy: gemm.bprop(gy, w, x.shape, (g.sh, g.sw), (g.ph, g.pw)),
             ("accgrad", "now"): lambda x, w, gy: gemm.accgrad(gy, x, w.shape, (g.sh, g.sw), (g.ph, g.pw))}
    if (g.sh, g.sw) == (1, 1):
        forms.update({("bprop", "wT"): bprop_wt, ("accgrad", "xg"): accgrad_xg,
                      ("accgrad", "cat"): accgrad_cat})
    return forms


def _cudnn(torch, pass_name, x, w, gy, g):
    """PyTorch's strict cuDNN for the pass (benchmark mode, every algorithm, TF32 off)."""
    xt, wt, gyt = (torch.from_dlpack(a) for a in (x, w, gy))
    if pass_name == "fprop":
        return lambda: torch.nn.functional.conv2d(xt, wt, stride=(g.sh, g.sw), padding=(g.ph, g.pw))
    mask = [pass_name == "bprop", pass_name == "accgrad", False]
    return lambda: torch.ops.aten.convolution_backward(gyt, xt, wt, None, [g.sh, g.sw], [g.ph, g.pw],
                                                       [1, 1], False, [0, 0], 1, mask)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--net", default="resnet50")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", help="write the rows as JSON to this file")
    args = ap.parse_args(argv)

    import cupy as cp
    import torch

    from backends import cgemm, gemm
    from backends.common import geometry

    setup_cudnn(torch)
    set_tf32("strict")
    rows = []
    for name, xs, ws, stride, padding, count in distinct_conv_layers(args.net, args.batch):
        if ws[2:] != (1, 1) or padding != (0, 0):
            continue
        g = geometry(xs, ws, stride, padding)
        rng = cp.random.default_rng(len(rows))
        x = rng.standard_normal(xs, dtype=cp.float32)
        w = rng.standard_normal(ws, dtype=cp.float32)
        gy = rng.standard_normal((g.S, g.fo, g.oh, g.ow), dtype=cp.float32)
        ref = reference64(x, w, gy, stride, padding)
        geom = f"{g.f}->{g.fo} {g.h}x{g.w} s{g.sh}"
        for (pass_name, form), fn in _forms(cp, gemm, cgemm, g).items():
            err = rel_error(fn(x, w, gy), ref[pass_name])
            ms = median_ms(lambda: fn(x, w, gy), "cupy", repeat=args.repeat)
            rows.append(dict(layer=name, geometry=geom, count=count, pass_name=pass_name, form=form, ms=ms,
                             err=err))
        for pass_name in ("fprop", "bprop", "accgrad"):
            ms = median_ms(_cudnn(torch, pass_name, x, w, gy, g), "torch", repeat=args.repeat)
            rows.append(dict(layer=name, geometry=geom, count=count, pass_name=pass_name, form="cudnn_strict",
                             ms=ms, err=None))
        del x, w, gy, ref
        cp.get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), batch=args.batch, rows=rows), f, indent=1)
    print(f"{torch.cuda.get_device_name()}, {args.net} 1x1 layers, batch {args.batch}; ms (median of "
          f"{args.repeat}), x = cuDNN strict's time over the form's, err = relative error against float64")
    strict = {(r["layer"], r["pass_name"]): r["ms"] for r in rows if r["form"] == "cudnn_strict"}
    for r in rows:
        if r["form"] == "cudnn_strict":
            continue
        print(f"  {r['layer']:7} {r['geometry']:22} x{r['count']} {r['pass_name']:8} {r['form']:4} "
              f"{r['ms']:7.3f} ms  x{strict[r['layer'], r['pass_name']] / r['ms']:5.2f}  err {r['err']:.1e}")
    for pass_name in ("fprop", "bprop", "accgrad"):
        mine = [r for r in rows if r["pass_name"] == pass_name and r["geometry"].endswith(" s1")]
        tot = {}
        for r in mine:
            tot[r["form"]] = tot.get(r["form"], 0) + r["ms"] * r["count"]
        print(f"  stride-1 1x1 layers' {pass_name}, weighted by count: "
              + ", ".join(f"{f} {t:.2f} ms" for f, t in tot.items()))


if __name__ == "__main__":
    main()

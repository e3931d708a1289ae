"""Experiment: the gemm backend's 1x1 passes against other GEMM forms of the same products, and cuDNN.

Session 12 asked first why ResNet-50's 1x1 bprop and accGrad ran at half cuDNN strict's speed
(64->256 at 56x56, b128: bprop 0.92, accGrad 1.19 ms against 0.48 / 0.65). This experiment at
e86f4ac timed, each checked against PyTorch float64 (results/nvidia-h100-80gb-hbm3/experiments/
exp_gemm_1x1_e86f4ac.json):

  bprop    W^T @ gy_s with W broadcast and cuBLAS's transpose flag, against W^T made contiguous
  accGrad  per-image gy_s @ x_s^T summed; per-image x_s @ gy_s^T summed; one GEMM on copies

and found that bprop and accGrad had not taken the 1x1 path at all. Wired in with the faster
forms (4197e11), the stride-1 layers' bprop and accGrad beat cuDNN summed over the network, but
the 7x7-plane layers (P = 49 pixels an image) and the stride-2 shortcuts still lose (ResNet-18's
256->512 s2 bprop 0.78x, ResNet-50's 1024->2048 s2 fprop 0.94x). The question now: do the
per-image (batched) GEMMs, N = P columns each, lose there to one flat GEMM over the whole batch
on transposed copies, N = S*P? Forms, every pass, stride 1 and 2:

  now    the backend as it is (per-image GEMMs; accGrad's flat form where its rule says)
  flat   x (or gy) transposed to (f, S*P) (a copy; the stride's gather folded in), one GEMM, the
         product transposed back into NCHW (bprop with a stride: into a zeroed gx)

  PYTHONPATH=. python3 benchmarks/experiments/exp_gemm_1x1.py --net resnet50 --batch 128
  PYTHONPATH=. python3 benchmarks/experiments/exp_gemm_1x1.py --cpu --batch 2   # the forms' check only
"""
import argparse
import json

import numpy as np

from benchmarks.harness import distinct_conv_layers, median_ms, reference64, rel_error, setup_cudnn, set_tf32


def _forms(xp, gemm, cgemm, g):
    """{(pass, form): fn(x, w, gy) -> result}, on NumPy or CuPy arrays."""
    P, stride, padding = g.oh * g.ow, (g.sh, g.sw), (g.ph, g.pw)

    def flat(a, planes):
        """a (S, planes, oh, ow) or its strided source -> (planes, S*P), a copy."""
        return xp.ascontiguousarray(a.transpose(1, 0, 2, 3)).reshape(planes, g.S * P)

    def fprop_flat(x, w, gy):
        xs = x[:, :, ::g.sh, ::g.sw]                                  # (S, f, oh, ow), a view
        y = cgemm.matmul(xp, w.reshape(g.fo, g.f), flat(xs, g.f), strict=True)   # (f', S*P)
        return xp.ascontiguousarray(y.reshape(g.fo, g.S, g.oh, g.ow).transpose(1, 0, 2, 3))

    def bprop_flat(x, w, gy):
        w2t = xp.ascontiguousarray(w.reshape(g.fo, g.f).T)           # (f, f')
        cols = cgemm.matmul(xp, w2t, flat(gy, g.fo), strict=True)      # (f, S*P)
        cols = cols.reshape(g.f, g.S, g.oh, g.ow).transpose(1, 0, 2, 3)
        if (g.sh, g.sw) == (1, 1):
            return xp.ascontiguousarray(cols)
        gx = xp.zeros((g.S, g.f, g.h, g.w), np.float32)
        gx[:, :, ::g.sh, ::g.sw] = cols
        return gx

    def accgrad_flat(x, w, gy):
        xs = x[:, :, ::g.sh, ::g.sw]
        gw = cgemm.matmul(xp, flat(gy, g.fo), flat(xs, g.f), op_b="T", strict=True)   # (f', f)
        return gw.reshape(g.fo, g.f, 1, 1)

    return {("fprop", "now"): lambda x, w, gy: gemm.fprop(x, w, stride, padding),
            ("fprop", "flat"): fprop_flat,
            ("bprop", "now"): lambda x, w, gy: gemm.bprop(gy, w, x.shape, stride, padding),
            ("bprop", "flat"): bprop_flat,
            ("accgrad", "now"): lambda x, w, gy: gemm.accgrad(gy, x, w.shape, stride, padding),
            ("accgrad", "flat"): accgrad_flat}


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
    ap.add_argument("--cpu", action="store_true", help="NumPy: check every form against float64, time nothing")
    ap.add_argument("--json", help="write the rows as JSON to this file")
    args = ap.parse_args(argv)

    import torch

    from minitorch_fft.backends import cgemm, gemm
    from minitorch_fft.backends.common import geometry

    if args.cpu:
        xp, device = np, "CPU (NumPy), no timing"
    else:
        import cupy as xp
        device = torch.cuda.get_device_name()
        setup_cudnn(torch)
        set_tf32("strict")
    rows = []
    for name, xs, ws, stride, padding, count in distinct_conv_layers(args.net, args.batch):
        if ws[2:] != (1, 1) or padding != (0, 0):
            continue
        g = geometry(xs, ws, stride, padding)
        rng = np.random.default_rng(len(rows))
        x, w, gy = (xp.asarray(rng.standard_normal(shape, dtype=np.float32))
                    for shape in (xs, ws, (g.S, g.fo, g.oh, g.ow)))
        ref = reference64(x, w, gy, stride, padding)
        geom = f"{g.f}->{g.fo} {g.h}x{g.w} s{g.sh}"
        for (pass_name, form), fn in _forms(xp, gemm, cgemm, g).items():
            err = rel_error(fn(x, w, gy), ref[pass_name])
            ms = None if args.cpu else median_ms(lambda: fn(x, w, gy), "cupy", repeat=args.repeat)
            rows.append(dict(layer=name, geometry=geom, count=count, pass_name=pass_name, form=form, ms=ms,
                             err=err))
        for pass_name in () if args.cpu else ("fprop", "bprop", "accgrad"):
            ms = median_ms(_cudnn(torch, pass_name, x, w, gy, g), "torch", repeat=args.repeat)
            rows.append(dict(layer=name, geometry=geom, count=count, pass_name=pass_name, form="cudnn_strict",
                             ms=ms, err=None))
        del x, w, gy, ref
        if not args.cpu:
            xp.get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, batch=args.batch, rows=rows), f, indent=1)
    print(f"{device}, {args.net} 1x1 layers, batch {args.batch}; ms (median of {args.repeat}), x = cuDNN "
          "strict's time over the form's, err = relative error against float64")
    strict = {(r["layer"], r["pass_name"]): r["ms"] for r in rows if r["form"] == "cudnn_strict"}
    for r in rows:
        if r["form"] == "cudnn_strict":
            continue
        timing = "" if r["ms"] is None else f"{r['ms']:7.3f} ms  x{strict[r['layer'], r['pass_name']] / r['ms']:5.2f}"
        print(f"  {r['layer']:7} {r['geometry']:22} x{r['count']} {r['pass_name']:8} {r['form']:4} {timing}"
              f"  err {r['err']:.1e}")
    worst = max(r["err"] for r in rows if r["err"] is not None)
    print(f"  largest error of any form: {worst:.1e}")
    if args.cpu:
        return
    for pass_name in ("fprop", "bprop", "accgrad"):
        tot = {}
        for r in rows:
            if r["pass_name"] == pass_name:
                tot[r["form"]] = tot.get(r["form"], 0) + r["ms"] * r["count"]
        best = sum(min(r["ms"] for r in rows if r["layer"] == layer and r["pass_name"] == pass_name
                       and r["form"] != "cudnn_strict") * count
                   for layer, count in {(r["layer"], r["count"]) for r in rows})
        print(f"  {pass_name}, every 1x1 layer weighted by count: "
              + ", ".join(f"{f} {t:.2f} ms" for f, t in tot.items()) + f", best form per layer {best:.2f} ms")


if __name__ == "__main__":
    main()

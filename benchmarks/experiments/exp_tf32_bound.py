"""Experiment (not a benchmark of record), on the CPU: how far each FFT and Winograd backend's
TF32-mode result is from float64, against a direct TF32 convolution's, per zoo layer and pass.

Session 30: OverFeat-fast's TF32-mode step failed its check twice (H100, H200): conv1's weight
gradient 2.8e-3 from float64 where PyTorch TF32's was 9.2e-4. auto checks a TF32 candidate
against strict gemm at cgemm.TF32_TOL (1e-2), which lets it through. The proposed bound: a
multiple (--factor, 2: the step check's) of what a direct TF32 convolution gives on the same
pass. This measures what that bound would refuse, without a GPU, by emulating TF32 where it
happens on the GPU:

- a TF32 GEMM rounds its operands to TF32 (10 mantissa bits) and accumulates products, exact in
  fp32, in fp32: cgemm.matmul is wrapped to round both operands (each float of a complex one) to
  nearest, ties away, for every non-strict call, which is every GEMM TF32 mode reaches;
- "direct TF32" (the yardstick, what cuDNN's TF32 implicit GEMM does) is the gemm backend in
  strict fp32 on operands rounded the same way.

Each backend that takes the pass on NumPy runs on the same operands; the table gives its error,
its ratio to direct TF32's, and "refused" where the ratio exceeds --factor. Not the GPU's numbers
(another summation order; cuDNN's own algorithms): the ratios are the point. The operands are
random (Gaussian), or with --real a training step's own: each conv's input, weight and output
gradient from the network's PyTorch model (benchmarks.harness.torch_model, initialised with
--seed, a Gaussian batch, cross-entropy on random labels, dropout off) in float64, as the step
check's gradients are made. With --gpu the same runs on CuPy operands, and beside the emulation each
backend runs in the real TF32 mode ("<backend> gpu": cuBLAS's TF32 GEMMs) and PyTorch's cuDNN runs
the pass with TF32 on ("cudnn gpu"): whether the GPU's TF32 arithmetic is what the emulation says.

winograd's tile is tuned on the GPU only: on the CPU it is F(2x2), so session 30's CPU runs said
nothing of F(4x4), which the GPU's tuner had picked for OverFeat-fast's 1024-plane layers in TF32
mode (2.1e-3, 7x direct TF32, on the GPU: session 31, which took F(4x4) out of TF32 mode).

  python -m benchmarks.experiments.exp_tf32_bound --nets overfeat_fast --batch 8
  python -m benchmarks.experiments.exp_tf32_bound --nets alexnet,resnet18 --batch 4 --passes accgrad
  python -m benchmarks.experiments.exp_tf32_bound --nets overfeat_fast --batch 4 --real
  python -m benchmarks.experiments.exp_tf32_bound --nets overfeat_fast --batch 128 --real --gpu --passes accgrad
"""
import argparse
import time
import unittest.mock

import numpy as np

from benchmarks.bench_pytorch import IMAGE
from benchmarks.harness import distinct_conv_layers, meta_lines, provenance, reference64, rel_error

BACKENDS = ("fbfft", "cufft", "tiledfft", "winograd", "polyphase")
PASSES = ("fprop", "bprop", "accgrad")


def round_tf32(a):
    """a (float32 or complex64, NumPy or CuPy) with every float rounded to TF32's 10 mantissa bits:
    to nearest, ties away from zero (cvt.rna.tf32.f32), as a new contiguous array of a's dtype."""
    xp = np
    if type(a).__module__.startswith("cupy"):
        import cupy as xp
    a = xp.ascontiguousarray(a)
    bits = a.view(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).view(a.dtype).reshape(a.shape)


def tf32_matmul(real):
    """cgemm.matmul with its operands rounded to TF32 where the GEMM is not strict."""
    def matmul(xp, a, b, out=None, op_a="N", op_b="N", accumulate=False, strict=False):
        if not strict:
            a, b = round_tf32(a), round_tf32(b)
        return real(xp, a, b, out=out, op_a=op_a, op_b=op_b, accumulate=accumulate, strict=strict)
    return matmul


def operands(pass_name, x, w, gy):
    return {"fprop": (x, w), "bprop": (gy, w), "accgrad": (gy, x)}[pass_name]


def run(backend, pass_name, a, b, x_shape, w_shape, stride, padding):
    third = {"fprop": (), "bprop": (x_shape,), "accgrad": (w_shape,)}[pass_name]
    return getattr(backend, pass_name)(a, b, *third, stride=stride, padding=padding)


def cudnn_tf32(pass_name, a, b, x_shape, w_shape, stride, padding):
    """The pass through PyTorch's cuDNN with TF32 on (its default), on CuPy operands."""
    import torch
    import torch.nn.functional as TF
    a, b = torch.as_tensor(a, device="cuda"), torch.as_tensor(b, device="cuda")
    was, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, True
    try:
        if pass_name == "fprop":
            return TF.conv2d(a, b, stride=stride, padding=padding)
        if pass_name == "bprop":
            return torch.nn.grad.conv2d_input(tuple(x_shape), b, a, stride=stride, padding=padding)
        return torch.nn.grad.conv2d_weight(b, tuple(w_shape), a, stride=stride, padding=padding)
    finally:
        torch.backends.cudnn.allow_tf32 = was


def random_layers(net, batch, seed):
    """[(name, x, w, gy, stride, padding)]: Gaussian operands for each distinct conv geometry."""
    rng = np.random.default_rng(seed)
    for name, x_shape, w_shape, stride, padding, _ in distinct_conv_layers(net, batch):
        oh = (x_shape[2] + 2 * padding[0] - w_shape[2]) // stride[0] + 1
        ow = (x_shape[3] + 2 * padding[1] - w_shape[3]) // stride[1] + 1
        shapes = (x_shape, w_shape, (x_shape[0], w_shape[0], oh, ow))
        yield (name, *(rng.standard_normal(s, dtype=np.float32) for s in shapes), tuple(stride), tuple(padding))


def step_layers(net, batch, seed, device="cpu"):
    """[(name, x, w, gy, stride, padding)]: every conv's input, weight and output gradient in one
    float64 training step of the network's PyTorch model (dropout off), as float32 arrays."""
    import torch

    from benchmarks.harness import torch_model
    torch.manual_seed(seed)
    model = torch_model(net, 1000).double().to(device)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.eval()
    seen = []

    def keep(module, inputs, output):
        seen.append((module, inputs[0].detach(), output))
        output.retain_grad()
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    hooks = [m.register_forward_hook(keep) for _, m in convs]
    g = torch.Generator().manual_seed(seed)
    side = IMAGE.get(net, 224)
    x = torch.randn(batch, 3, side, side, generator=g, dtype=torch.float64).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for h in hooks:
        h.remove()
    names = {m: n for n, m in convs}
    for module, xin, out in seen:
        yield (names[module], xin.float().cpu().numpy(), module.weight.detach().float().cpu().numpy(),
               out.grad.float().cpu().numpy(), tuple(module.stride), tuple(module.padding))


def layer_rows(net, batch, passes, factor, seed, real=False, gpu=False):
    """The table's rows for one network. gpu: the operands on the GPU, each backend also run in
    the real TF32 mode (cuBLAS's TF32 GEMMs: "<backend> gpu") and cuDNN's TF32 pass beside them."""
    from minitorch_fft import backends
    from minitorch_fft.backends import cgemm, config, gemm
    rows = []
    layers = step_layers(net, batch, seed, "cuda" if gpu else "cpu") if real else random_layers(net, batch, seed)
    for name, x, w, gy, stride, padding in layers:
        x_shape, w_shape = x.shape, w.shape
        if gpu:
            import cupy
            x, w, gy = (cupy.asarray(t) for t in (x, w, gy))
        refs = reference64(x, w, gy, stride, padding)
        for pass_name in passes:
            ref = refs[pass_name]
            a, b = operands(pass_name, x, w, gy)
            args = (x_shape, w_shape, stride, padding)
            direct = rel_error(run(gemm, pass_name, round_tf32(a), round_tf32(b), *args), ref)
            fp32 = rel_error(run(gemm, pass_name, a, b, *args), ref)
            row = {"net": net, "layer": name, "pass": pass_name, "direct": direct, "gemm fp32": fp32}
            with unittest.mock.patch.object(cgemm, "matmul", tf32_matmul(cgemm.matmul)):
                for bname in BACKENDS:
                    backend = backends.get(bname)
                    if not backend.supports(x_shape, w_shape, stride, padding):
                        continue
                    try:
                        row[bname] = rel_error(run(backend, pass_name, a, b, *args), ref)
                    except Exception as e:   # a GPU-only path: say so, go on
                        row[bname] = f"{type(e).__name__}"
            if gpu:
                with config.override(tf32=True):
                    for bname in [k for k in BACKENDS if isinstance(row.get(k), float)]:
                        row[f"{bname} gpu"] = rel_error(run(backends.get(bname), pass_name, a, b, *args), ref)
                row["cudnn gpu"] = rel_error(cudnn_tf32(pass_name, a, b, *args), ref)
            rows.append(row)
            cells = "  ".join(f"{k} {v:.1e} ({v / direct:.1f}x{', refused' if v > factor * direct else ''})"
                              if isinstance(v, float) else f"{k} {v}"
                              for k, v in row.items() if k.split(" ")[0] in BACKENDS + ("cudnn",))
            print(f"{net:13s} {name:12s} {pass_name:8s} direct TF32 {direct:.1e} (fp32 {fp32:.1e})  {cells}",
                  flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default="overfeat_fast", help="comma-separated zoo networks")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--passes", default=",".join(PASSES))
    ap.add_argument("--factor", type=float, default=2.0, help="the bound: this times direct TF32's error")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real", action="store_true", help="a training step's operands instead of random ones")
    ap.add_argument("--gpu", action="store_true",
                    help="on the GPU (CuPy): each backend also in real TF32 mode, and cuDNN's TF32 pass")
    args = ap.parse_args()
    passes = args.passes.split(",")
    if args.batch < 1 or args.factor <= 0 or any(p not in PASSES for p in passes):
        ap.error(f"need --batch >= 1, --factor > 0, --passes of {', '.join(PASSES)}")
    import torch
    if args.gpu and not torch.cuda.is_available():
        ap.error("--gpu needs a CUDA GPU that PyTorch sees (and CuPy)")
    device = f"{torch.cuda.get_device_name()} (CuPy)" if args.gpu else "CPU (NumPy)"
    print("\n".join(meta_lines(provenance(f"{device}, TF32 emulated", numpy=np.__version__,
                                           torch=torch.__version__))), flush=True)
    t0 = time.perf_counter()
    rows = [r for net in args.nets.split(",")
            for r in layer_rows(net, args.batch, passes, args.factor, args.seed, args.real, args.gpu)]
    runs = [(r[b] / r["direct"], b) for r in rows for b in BACKENDS if isinstance(r.get(b), float)]
    refused = sum(ratio > args.factor for ratio, _ in runs)
    print(f"\n{len(rows)} layer-passes, {len(runs)} backend runs, {refused} over {args.factor}x direct TF32's "
          f"error; {time.perf_counter() - t0:.0f} s")
    measured = BACKENDS + tuple(f"{b} gpu" for b in BACKENDS) + ("cudnn gpu",)   # the last two: --gpu's
    for name in measured:
        mine = sorted(r[name] / r["direct"] for r in rows if isinstance(r.get(name), float))
        if mine:
            print(f"  {name:14s} {len(mine):3d} runs, ratio to direct TF32 median {mine[len(mine) // 2]:.1f}x, "
                  f"max {mine[-1]:.1f}x, over {args.factor}x {sum(r > args.factor for r in mine)}")


if __name__ == "__main__":
    main()

"""Experiment (not a benchmark of record): what the PyTorch adapter's custom operator costs a call on
the host, depth by depth, and where cProfile puts a compiled step's time.

Session 33 (H200, torch 2.11, Python 3.12, inductor): under cProfile a compiled converted AlexNet
step spent 7.8 ms a step of own time in torch's custom_ops.py `backend_impl`, a wrapper of a few
lines, while our passes (`_run`) were listed apart. This times one small layer's calls: `--repeat`
timeit rounds of `--number` calls of each depth, the depths' rounds taken in turn, the median and
the least of them (host time: on a GPU the queue is drained before each round, nothing inside a
round is waited for):

  kernel fn         the operator's own function (custom_op's _init_fn): what every depth runs
  ops no_grad       torch.ops.minitorch_fft.conv2d under no_grad (the packet's overload look-up,
                    the dispatcher, the autograd kernel, custom_op's backend wrapper)
  .default no_grad  the same through the overload, as inductor's generated code calls it
  ops autograd      the operator with a weight that needs a gradient (its autograd node made)
  EagerConv2d       what an eager call runs instead: the same passes as an autograd.Function
  _grads            the backward's helper alone (bias gradient, accGrad, bprop)
  grads kernel fn   conv2d_grads' own function (_grads in a reuse_spectra block of its own)
  grads operator    torch.ops.minitorch_fft.conv2d_grads

then runs a five-layer model of that layer compiled (aot_eager on the CPU, inductor on a GPU) under
cProfile and prints the own and cumulative time of `backend_impl` and of our `_run`: whether the
profiler sees our passes below the wrapper.

  python -m benchmarks.experiments.exp_op_dispatch                   # CPU, a 1x4x6x6 input on gemm
  python -m benchmarks.experiments.exp_op_dispatch --device cuda --backend auto
"""
import argparse
import cProfile
import pstats
import statistics
import timeit


def per_call_us(fns, sync, number, repeat):
    """[(median, least)] us a call of each of fns over `repeat` rounds of `number` calls, the rounds
    taken in turn (fn 1, fn 2, ..., fn 1, ...: a slow spell of a shared host falls on all of them);
    sync() before each round."""
    for fn in fns:
        fn()
    rounds = [[] for _ in fns]
    for _ in range(repeat):
        for fn, kept in zip(fns, rounds):
            sync()
            kept.append(timeit.timeit(fn, number=number) / number * 1e6)
    sync()
    return [(statistics.median(kept), min(kept)) for kept in rounds]


def depths(x, w, b, gy, backend, stride, padding):
    """[(name, fn)]: the operator's call depths (module docstring)."""
    import torch

    import minitorch_fft.pytorch as mp
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    ops = torch.ops.minitorch_fft
    mask = [True, True, True]

    def no_grad(fn):
        def call():
            with torch.no_grad():
                return fn()
        return call
    return [
        ("kernel fn", lambda: mp._conv2d._init_fn(xd, wd, stride, padding, backend, bd)),
        ("ops no_grad", no_grad(lambda: ops.conv2d(xd, wd, stride, padding, backend, bd))),
        (".default no_grad", no_grad(lambda: ops.conv2d.default(xd, wd, stride, padding, backend, bd))),
        ("ops autograd", lambda: ops.conv2d(x, w, stride, padding, backend, b)),
        ("EagerConv2d", lambda: mp.EagerConv2d.apply(x, w, stride, padding, backend, b)),
        ("_grads", lambda: mp._grads(gy, xd, wd, stride, padding, backend, True, True, True)),
        ("grads kernel fn", lambda: mp._conv2d_grads._init_fn(gy, xd, wd, stride, padding, backend, mask)),
        ("grads operator", lambda: ops.conv2d_grads(gy, xd, wd, stride, padding, backend, mask)),
    ]


def compiled_profile(model, x, steps, compile_backend):
    """{function: (own s, cumulative s, calls)} for custom_ops' backend_impl and our _run over `steps`
    compiled forward+backward steps under cProfile (the compile and a warm-up before)."""
    import torch
    run = torch.compile(model, backend=compile_backend, fullgraph=True)

    def step():
        run(x).sum().backward()
    for _ in range(3):
        step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    if x.is_cuda:
        torch.cuda.synchronize()
    profiler.disable()
    found = {}
    for (filename, _, name), (_, calls, own, cumulative, _) in pstats.Stats(profiler).stats.items():
        if (name == "backend_impl" and filename.endswith("custom_ops.py")) or \
                (name == "_run" and filename.endswith("minitorch_fft/pytorch.py")):
            found[name] = (own, cumulative, calls)
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--backend", default="gemm", help="the operator's backend (default gemm: on both devices)")
    ap.add_argument("--shape", default="1,4,6,6", help="S,f,h,w of the input (f output planes, 3x3, pad 1)")
    ap.add_argument("--number", type=int, default=1000, help="calls a round")
    ap.add_argument("--repeat", type=int, default=7, help="rounds of each depth (their median and least are printed)")
    ap.add_argument("--steps", type=int, default=100, help="compiled steps under cProfile")
    args = ap.parse_args()
    S, f, h, w_ = (int(v) for v in args.shape.split(","))

    import torch

    import minitorch_fft.pytorch as mp
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    torch.manual_seed(0)
    dev = torch.device(args.device)
    x = torch.randn(S, f, h, w_, device=dev)
    w = torch.randn(f, f, 3, 3, device=dev, requires_grad=True)
    b = torch.randn(f, device=dev, requires_grad=True)
    gy = torch.randn(S, f, h, w_, device=dev)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"torch {torch.__version__}, device {args.device}, backend {args.backend}, input {tuple(x.shape)}, "
          f"weight {tuple(w.shape)}; us a call over {args.repeat} rounds of {args.number}: median (least)")
    names, fns = zip(*depths(x, w, b, gy, args.backend, [1, 1], [1, 1]))
    for name, (median, least) in zip(names, per_call_us(fns, sync, args.number, args.repeat)):
        print(f"  {name:18s} {median:8.1f} ({least:.1f})")

    model = torch.nn.Sequential(*[m for _ in range(5) for m in (torch.nn.Conv2d(f, f, 3, padding=1), torch.nn.ReLU())])
    model = mp.convert(model.to(dev), backend=args.backend)
    compile_backend = "inductor" if args.device == "cuda" else "aot_eager"
    found = compiled_profile(model, x, args.steps, compile_backend)
    print(f"compiled ({compile_backend}) five-layer step under cProfile, {args.steps} steps: ms a step, own / cumulative")
    for name in ("backend_impl", "_run"):
        own, cumulative, calls = found.get(name, (0.0, 0.0, 0))
        print(f"  {name:14s} {own * 1e3 / args.steps:8.3f} / {cumulative * 1e3 / args.steps:8.3f}  "
              f"({calls / args.steps:.0f} calls a step)")


if __name__ == "__main__":
    main()

"""Experiment (not a benchmark of record): issue 17's last per-layer shortfalls of auto (with the
cudnn candidate) are 1x1 fprops of 0.07-0.7 ms (table3 at f7d2e1a: ResNet-18's stride-2 shortcuts
0.92-0.96x, ResNet-50's conv2 and conv25 0.96x). Is it the host (our dispatch and the frontend's
execute cost more than the kernel takes, and table3's bursts of five calls show it), or the GPU
(our engine search kept another engine than PyTorch's cudnn.benchmark)?

For each layer-pass, side by side in one process: GPU-only time (a spin kernel hides the enqueue),
back-to-back time per call (bursts of five, as table3), and host time per call (the host clock,
nothing synchronised); for PyTorch's cuDNN strict, our cudnn backend called directly, backends.run_pass
with the backend set to "cudnn", and auto (with cudnn) as a layer dispatches it. Then a profile of
auto's calls on the first layer-pass.

  PYTHONPATH=. python3 benchmarks/experiments/exp_host_cudnn.py      # a CUDA GPU, cuDNN frontend
"""
import cProfile
import io
import pstats

import cupy as cp
import torch

import backends
from backends import config
from benchmarks.harness import Layer, median_ms

CASES = [  # (name, x shape, w shape, stride, pass)
    ("resnet18 conv8", (128, 64, 56, 56), (128, 64, 1, 1), (2, 2), "fprop"),
    ("resnet18 conv13", (128, 128, 28, 28), (256, 128, 1, 1), (2, 2), "fprop"),
    ("resnet18 conv18", (128, 256, 14, 14), (512, 256, 1, 1), (2, 2), "fprop"),
    ("resnet50 conv2", (128, 64, 56, 56), (64, 64, 1, 1), (1, 1), "fprop"),
    ("resnet50 conv25", (128, 512, 28, 28), (256, 512, 1, 1), (1, 1), "fprop"),
]


def timings(fn, lib):
    """(GPU-only, back-to-back per call, host per call) in ms."""
    fn()
    gpu = median_ms(fn, lib, 3, 30, spin_us=3000) if lib == "cupy" else float("nan")
    b2b = median_ms(lambda: [fn() for _ in range(5)], lib, 3, 30) / 5
    sync = cp.cuda.Device().synchronize if lib == "cupy" else torch.cuda.synchronize
    host = median_ms(fn, "cpu", 3, 30, before=sync)
    return gpu, b2b, host


def main():
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{'layer-pass':24} {'what':18} {'gpu ms':>8} {'b2b ms':>8} {'host ms':>8}  choice")
    profiled = None
    for name, xs, ws, stride, p in CASES:
        layer = Layer(xs, ws, stride, (0, 0), seed=0)
        rows = [("torch strict", layer.cudnn(p), "torch", "")]
        if backends.get("cudnn").available():
            rows += [("cudnn direct", layer.ours(backends.get("cudnn"), p), "cupy", ""),
                     ("run_pass cudnn", layer.dispatched("cudnn", p), "cupy", "")]
        fn = layer.dispatched("auto", p)
        fn()
        choice = backends.choose("auto", p, xs, ws, stride, (0, 0), cp).__name__.split(".")[-1]
        rows.append(("auto", fn, "cupy", choice))
        profiled = profiled or fn
        for what, f, lib, note in rows:
            gpu, b2b, host = timings(f, lib)
            print(f"{name + ' ' + p:24} {what:18} {gpu:8.4f} {b2b:8.4f} {host:8.4f}  {note}", flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        profiled()
    pr.disable()
    cp.cuda.Device().synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(f"\nauto's calls on {CASES[0][0]} ({CASES[0][4]}), 300 calls, by own time:")
    print(s.getvalue())
    print("settings:", {k: config.get(k) for k in ("auto_backends",)})


if __name__ == "__main__":
    main()

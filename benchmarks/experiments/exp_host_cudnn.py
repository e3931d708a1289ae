"""Experiment (not a benchmark of record): issue 17's last per-layer shortfalls of auto (with the
cudnn candidate) are 1x1 fprops of 0.07-0.7 ms (table3 at f7d2e1a: ResNet-18's stride-2 shortcuts
0.92-0.96x, ResNet-50's conv2 and conv25 0.96x). Is it the host (our dispatch and the frontend's
execute cost more than the kernel takes, and table3's bursts of five calls show it), or the GPU
(our engine search kept another engine than PyTorch's cudnn.benchmark)?

For each layer-pass, side by side in one process: GPU-only time (a spin kernel hides the enqueue),
back-to-back time per call (bursts of five, as table3), and host time per call (the host clock,
nothing synchronised); for PyTorch's cuDNN strict, our cudnn backend called directly, backends.run_pass
with the backend set to "cudnn", run_pass with "gemm" (its tuned form; the fused kernel on the strided
ones where it won), auto over our own algorithms (auto_backends=ours) and auto (with cudnn) as a
layer dispatches them, and gemm's module call as auto's tuner timed it before session 20. Then profiles of
the PROFILED rows.

Session 20 added the gemm and auto[ours] rows and the shortcuts' bprops, for run_pass's prepared
path: run it on the tree before that (PYTHONPATH=<old tree>) and after, in one call.

Session 22 added --tf32 (the framework's TF32 mode against PyTorch's cuDNN TF32) and --cases
resnet50_tf32: table3 at b00c402 had every ResNet-50 fprop that auto gives to cudnn in TF32 mode at
0.97-0.99x PyTorch's cuDNN TF32 (conv14 0.966x), bprop and accGrad not. Is it the kernel (another
plan), or the host? PyTorch's rows get a GPU-only time too (its conv runs on the same legacy
default stream as CuPy's spin kernel), and each of our rows names the cuDNN plan it ran.

  PYTHONPATH=. python3 benchmarks/experiments/exp_host_cudnn.py      # a CUDA GPU, cuDNN frontend
  PYTHONPATH=. python3 benchmarks/experiments/exp_host_cudnn.py --tf32 --cases resnet50_tf32
  PYTHONPATH=. python3 benchmarks/experiments/exp_host_cudnn.py --tf32 --cases resnet18_tf32 --no-profile
  PYTHONPATH=. python3 benchmarks/experiments/exp_host_cudnn.py --tf32 --cases h200_tf32 --no-profile   # session 40's
  PYTHONPATH=. python3 benchmarks/experiments/exp_host_cudnn.py --tf32 --cases s65_tf32 --also tiledfft --no-profile
  PYTHONPATH=. python3 benchmarks/experiments/exp_host_cudnn.py --tf32 --cases s66_tf32 --also winograd --no-profile
  PYTHONPATH=. python3 benchmarks/experiments/exp_host_cudnn.py --tf32 --cases s67_alexnet --also fbfft,polyphase --no-profile
  PYTHONPATH=. python3 benchmarks/experiments/exp_host_cudnn.py --cases s67_tiledfft --also tiledfft --no-profile

Each --also backend gets two rows: run_pass (a layer's call: its prepared path from the second call on) and
its pass function called directly (the full call, minus the dispatch).
"""
import argparse
import cProfile
import io
import pstats

import cupy as cp
import torch

from minitorch_fft import backends
from minitorch_fft.backends import config
from benchmarks.harness import Layer, median_ms

CASES = [  # (name, x shape, w shape, stride, pass)
    ("resnet18 conv8", (128, 64, 56, 56), (128, 64, 1, 1), (2, 2), "fprop"),
    ("resnet18 conv13", (128, 128, 28, 28), (256, 128, 1, 1), (2, 2), "fprop"),
    ("resnet18 conv18", (128, 256, 14, 14), (512, 256, 1, 1), (2, 2), "fprop"),
    ("resnet18 conv8", (128, 64, 56, 56), (128, 64, 1, 1), (2, 2), "bprop"),
    ("resnet18 conv13", (128, 128, 28, 28), (256, 128, 1, 1), (2, 2), "bprop"),
    ("resnet50 conv2", (128, 64, 56, 56), (64, 64, 1, 1), (1, 1), "fprop"),
    ("resnet50 conv25", (128, 512, 28, 28), (256, 512, 1, 1), (1, 1), "fprop"),
    ("resnet50 conv28", (128, 512, 28, 28), (1024, 512, 1, 1), (2, 2), "fprop"),   # a tie, session 20
]
# ResNet-50's TF32-mode fprops below 0.99x cuDNN TF32 in table3 (b00c402), and one accGrad that was not
CASES_RESNET50_TF32 = [
    ("resnet50 conv14", (128, 128, 28, 28), (512, 128, 1, 1), (1, 1), "fprop"),     # 0.966x
    ("resnet50 conv2", (128, 64, 56, 56), (64, 64, 1, 1), (1, 1), "fprop"),         # 0.98x
    ("resnet50 conv4", (128, 64, 56, 56), (256, 64, 1, 1), (1, 1), "fprop"),        # 0.98x
    ("resnet50 conv29", (128, 1024, 14, 14), (256, 1024, 1, 1), (1, 1), "fprop"),   # 0.98x
    ("resnet50 conv14", (128, 128, 28, 28), (512, 128, 1, 1), (1, 1), "accgrad"),   # 1.05x
]

# ResNet-18's TF32-mode fprops below 0.97x cuDNN TF32 in table3 at 7b9d590 (session 23: cuDNN's search
# in bursts of four, on a machine whose host probe read 6.97 ms against 3.77 at 74bf06d), and conv2,
# the one that search was for; (..., padding) where it is not zero
CASES_RESNET18_TF32 = [
    ("resnet18 conv11", (128, 128, 28, 28), (256, 128, 3, 3), (2, 2), "fprop", (1, 1)),   # 0.964x
    ("resnet18 conv12", (128, 256, 14, 14), (256, 256, 3, 3), (1, 1), "fprop", (1, 1)),   # 0.918x
    ("resnet18 conv2", (128, 64, 56, 56), (64, 64, 3, 3), (1, 1), "fprop", (1, 1)),       # 1.02x (0.947x before)
]
# The TF32-mode fprops under 0.97x cuDNN TF32 in the H200's table3 at a4570ad (session 40), all on cudnn
CASES_H200_TF32 = [
    ("vgg16 conv11", (64, 512, 14, 14), (512, 512, 3, 3), (1, 1), "fprop", (1, 1)),       # 0.951x
    ("resnet50 conv17", (128, 128, 28, 28), (128, 128, 3, 3), (1, 1), "fprop", (1, 1)),   # 0.955x
    ("resnet50 conv14", (128, 128, 28, 28), (512, 128, 1, 1), (1, 1), "fprop"),           # 0.966x
    ("resnet50 conv26", (128, 256, 28, 28), (256, 256, 3, 3), (2, 2), "fprop", (1, 1)),   # 0.969x
    ("resnet50 conv29", (128, 1024, 14, 14), (256, 1024, 1, 1), (1, 1), "fprop"),         # 0.96x (session 64)
]
# ResNet-50's stride-2 1x1 fprops in fp32 (session 64): table3 has conv47's auto (with cudnn) on cudnn at 0.98-1.01x
# cuDNN strict where auto[ours] runs gemm 1.16-1.22x faster; auto's tuner (single calls) timed gemm 0.879 ms, cudnn 0.841
CASES_SHORTCUTS_S64 = [
    ("resnet50 conv47", (128, 1024, 14, 14), (2048, 1024, 1, 1), (2, 2), "fprop"),
    ("resnet50 conv28", (128, 512, 28, 28), (1024, 512, 1, 1), (2, 2), "fprop"),
    ("resnet50 conv15", (128, 256, 56, 56), (512, 256, 1, 1), (2, 2), "fprop"),
]
# Session 65: with auto timing bursts, ResNet-18's conv7 TF32 bprop went to tiledfft (0.162 ms in tuning against
# cudnn's 0.163) and table3 ran it at 0.243 (0.71x cuDNN TF32); ResNet-50's conv17, the same geometry and record, 0.160
CASES_S65_TF32 = [
    ("resnet18 conv7", (128, 128, 28, 28), (128, 128, 3, 3), (1, 1), "bprop", (1, 1)),
    ("resnet18 conv7", (128, 128, 28, 28), (128, 128, 3, 3), (1, 1), "accgrad", (1, 1)),
]
# Session 66: the TF32-mode fprops lowest against cuDNN TF32 in table3 at 844c3a5 and cd0ccf2 (auto runs cudnn on both)
CASES_S66_TF32 = [
    ("overfeat_fast conv3", (128, 256, 12, 12), (512, 256, 3, 3), (1, 1), "fprop", (1, 1)),   # 0.959x
    ("resnet50 conv44", (128, 1024, 14, 14), (512, 1024, 1, 1), (1, 1), "fprop"),             # 0.97x
]
# Session 67: converted AlexNet b128's passes that auto runs on fbfft or polyphase in TF32 mode (its eager and compiled
# steps host-bound), for their prepare()d calls (run_pass) beside their pass functions (--also fbfft,polyphase)
CASES_S67_ALEXNET = [
    ("alexnet conv1", (128, 3, 224, 224), (64, 3, 11, 11), (4, 4), "fprop", (2, 2)),
    ("alexnet conv1", (128, 3, 224, 224), (64, 3, 11, 11), (4, 4), "accgrad", (2, 2)),
    ("alexnet conv2", (128, 64, 27, 27), (192, 64, 5, 5), (1, 1), "fprop", (2, 2)),
    ("alexnet conv2", (128, 64, 27, 27), (192, 64, 5, 5), (1, 1), "bprop", (2, 2)),
    ("alexnet conv2", (128, 64, 27, 27), (192, 64, 5, 5), (1, 1), "accgrad", (2, 2)),
    ("alexnet conv3", (128, 192, 13, 13), (384, 192, 3, 3), (1, 1), "accgrad", (1, 1)),
    ("alexnet conv4", (128, 384, 13, 13), (256, 384, 3, 3), (1, 1), "fprop", (1, 1)),
    ("alexnet conv5", (128, 256, 13, 13), (256, 256, 3, 3), (1, 1), "accgrad", (1, 1)),
]
# Session 67: ResNet-18 b128's passes that auto runs on tiledfft in fp32 (conv2's 56x56 layer, conv7's bprop), for
# tiledfft's prepare()d calls beside its pass function (--also tiledfft)
CASES_S67_TILEDFFT = [
    ("resnet18 conv2", (128, 64, 56, 56), (64, 64, 3, 3), (1, 1), "fprop", (1, 1)),
    ("resnet18 conv2", (128, 64, 56, 56), (64, 64, 3, 3), (1, 1), "bprop", (1, 1)),
    ("resnet18 conv2", (128, 64, 56, 56), (64, 64, 3, 3), (1, 1), "accgrad", (1, 1)),
    ("resnet18 conv7", (128, 128, 28, 28), (128, 128, 3, 3), (1, 1), "bprop", (1, 1)),
]
CASE_SETS = {"shortcuts": CASES,
             "s67_alexnet": CASES_S67_ALEXNET,
             "s67_tiledfft": CASES_S67_TILEDFFT,
             "s66_tf32": CASES_S66_TF32,
             "shortcuts_s64": CASES_SHORTCUTS_S64,
             "s65_tf32": CASES_S65_TF32,
             "resnet50_tf32": CASES_RESNET50_TF32,
             "resnet18_tf32": CASES_RESNET18_TF32,
             "h200_tf32": CASES_H200_TF32}


def timings(fn, lib):
    """(GPU-only, back-to-back per call, host per call, one call from an idle GPU) in ms. PyTorch's
    GPU-only time is taken on CuPy's events too: both libraries queue on the legacy default stream
    here. The last is what auto's tuner times (tuning.timeit with inner=1): events around a single
    call, its host time up to its launches counted."""
    fn()
    gpu = median_ms(fn, "cupy", 3, 30, spin_us=3000)
    b2b = median_ms(lambda: [fn() for _ in range(5)], lib, 3, 30) / 5
    sync = cp.cuda.Device().synchronize if lib == "cupy" else torch.cuda.synchronize
    host = median_ms(fn, "cpu", 3, 30, before=sync)
    single = median_ms(fn, lib, 3, 30)
    return gpu, b2b, host, single


def plan_of(p, xs, ws, stride, pad=(0, 0)):
    """The name of the cuDNN plan built in this process for the pass and shapes (current settings)."""
    g = backends.geometry(xs, ws, stride, pad)
    key = backends.get("cudnn")._plan_key(cp, p, g)
    return backends.get("cudnn").built().get(key, ("",))[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tf32", action="store_true", help="the framework's TF32 mode against PyTorch's cuDNN TF32")
    ap.add_argument("--cases", choices=list(CASE_SETS), default="shortcuts")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--also", default="", help="comma-separated backends (not gemm or cudnn, which have their rows) "
                    "to add as a run_pass row and a direct row each, where they take the case (e.g. tiledfft)")
    args = ap.parse_args()
    if {"gemm", "cudnn"} & set(args.also.split(",")):
        ap.error("--also: gemm and cudnn have their rows already")
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    with config.override(tf32=args.tf32):
        run(args)


def run(args):
    mode = "tf32" if args.tf32 else "strict"
    print(f"{'layer-pass':24} {'what':18} {'gpu ms':>8} {'b2b ms':>8} {'host ms':>8} {'one ms':>8}  choice")
    profiled = {}
    for name, xs, ws, stride, p, *padding in CASE_SETS[args.cases]:
        pad = padding[0] if padding else (0, 0)
        layer = Layer(xs, ws, stride, pad, seed=0)
        rows = [(f"torch {mode}", layer.cudnn(p), "torch", "")]
        if backends.get("cudnn").available():
            rows += [("cudnn direct", layer.ours(backends.get("cudnn"), p), "cupy", ""),
                     ("run_pass cudnn", layer.dispatched("cudnn", p), "cupy", "")]
        rows.append(("run_pass gemm", layer.dispatched("gemm", p), "cupy", ""))
        for b in filter(None, args.also.split(",")):   # as a layer runs it (prepared), and its pass function
            if not backends.get(b).supports(xs, ws, stride, pad):
                print(f"{name + ' ' + p:24} {b} does not take this case: no rows", flush=True)
                continue
            rows += [(f"run_pass {b}", layer.dispatched(b, p), "cupy", ""),
                     (f"{b} direct", layer.ours(backends.get(b), p), "cupy", "")]
        for what, restrict in (("auto[ours]", "ours"), ("auto", None)):
            with config.override(auto_backends=restrict):
                fn = layer.dispatched("auto", p)
                fn()
                choice = backends.choose("auto", p, xs, ws, stride, pad, cp).__name__.split(".")[-1]
            rows.append((what, fn, "cupy", choice, restrict))
        rows.append(("gemm direct", layer.ours(backends.get("gemm"), p), "cupy", ""))
        for what, f, lib, note, *restrict in rows:
            with config.override(auto_backends=restrict[0] if restrict else None):
                gpu, b2b, host, single = timings(f, lib)
            if "cudnn" in (what + note) and backends.get("cudnn").available():
                note = f"{note} {plan_of(p, xs, ws, stride, pad)}".strip()
            print(f"{name + ' ' + p:24} {what:18} {gpu:8.4f} {b2b:8.4f} {host:8.4f} {single:8.4f}  {note}", flush=True)
            profiled[(name + " " + p, what)] = (f, restrict[0] if restrict else None)
    for case in ([] if args.no_profile else PROFILED):
        if case not in profiled:
            continue
        f, restrict = profiled[case]
        with config.override(auto_backends=restrict):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(300):
                f()
            pr.disable()
        cp.cuda.Device().synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
        print(f"\n{case[1]} on {case[0]}, 300 calls, by own time:")
        print(s.getvalue())


# (layer-pass, row) profiled after the table: auto's cudnn call, and gemm's host paths
PROFILED = [("resnet18 conv8 fprop", "auto"), ("resnet18 conv8 fprop", "gemm direct"),
            ("resnet18 conv8 bprop", "run_pass gemm"), ("resnet50 conv2 fprop", "run_pass gemm")]


if __name__ == "__main__":
    main()

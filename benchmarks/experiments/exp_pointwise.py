"""Experiment: the fused gather + GEMM of strided 1x1 convolutions (kernels/pointwise.cu, gemm's
"fused" and "fused64" forms) on ResNet's stride-2 shortcuts, against gemm's other forms and cuDNN.

On an H100 at batch 128, gemm's fprop (the gather x[:, :, ::2, ::2] copied, then a cuBLAS GEMM per
image) took 0.12-0.17 ms on these three layers and cuDNN strict 0.065-0.074; each is 1.64 GFLOP and
~100 MB of traffic (x read at even rows, y written), so a fused kernel near memory speed could take
0.04-0.05 ms. Per layer and pass (fprop, bprop), each gemm form forced, its answer checked against
PyTorch float64 (1e-5), then timed, as is cuDNN strict (torch, TF32 off, benchmark mode over every
algorithm):

  gpu   GPU time only: a spin kernel keeps the GPU busy while the host enqueues the call, CUDA
        events around it on the legacy default stream (CuPy's and PyTorch's both, checked below)
  b2b   per call in bursts of five, each library's own events: what the host's dispatch adds

medians of --repeat timed calls after --warmup. Then the form gemm's tuner picks (gemm_tune on, a
fresh cache file) and its record's times.

  PYTHONPATH=. python3 benchmarks/experiments/exp_pointwise.py
  PYTHONPATH=. python3 benchmarks/experiments/exp_pointwise.py --batch 64 --repeat 50 --out pointwise.json
"""
import argparse
import contextlib
import json
import tempfile
from pathlib import Path

import cupy as cp
import torch

from minitorch_fft.backends import config, gemm, tuning
from benchmarks.harness import Layer, median_ms, rel_error, set_tf32, setup_cudnn

LAYERS = [("64->128 56x56 s2", (64, 56, 56), (128, 64, 1, 1)),     # ResNet-18's conv8 (ResNet-50's too)
          ("128->256 28x28 s2", (128, 28, 28), (256, 128, 1, 1)),  # conv13
          ("256->512 14x14 s2", (256, 14, 14), (512, 256, 1, 1))]  # conv18
PASSES = ("fprop", "bprop")
TOL = 1e-5
SPIN_US = 2000   # longer than any call's enqueue here


@contextlib.contextmanager
def forced(form):
    """gemm's 1x1 passes run `form` (its tuner and rule set aside)."""
    real = gemm._form
    gemm._form = lambda xp, pass_name, g, run, forms=None: form
    try:
        yield
    finally:
        gemm._form = real


def timings(fn, lib, args, shared_stream):
    """(gpu ms, back-to-back ms per call): the module docstring's two clocks."""
    gpu = median_ms(fn, "cupy", args.warmup, args.repeat, spin_us=SPIN_US) if shared_stream or lib == "cupy" \
        else float("nan")
    b2b = median_ms(lambda: [fn() for _ in range(5)], lib, args.warmup, args.repeat) / 5
    return gpu, b2b


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--out", type=Path, help="the rows as JSON")
    args = parser.parse_args()
    setup_cudnn(torch)
    set_tf32("strict")
    # cuDNN's calls are timed by CuPy's events (and spin kernel) only where both queue on stream 0
    shared_stream = torch.cuda.current_stream().cuda_stream == 0 and cp.cuda.get_current_stream().ptr == 0
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, batch {args.batch}, "
          f"{'shared' if shared_stream else 'separate'} default streams")
    print(f"{'layer':18} {'pass':6} {'form':10} {'gpu ms':>8} {'b2b ms':>8} {'rel err':>9}")
    rows = []
    for name, (f, h, w), ws in LAYERS:
        layer = Layer((args.batch, f, h, w), ws, (2, 2), (0, 0), seed=0)
        for p in PASSES:
            def report(form, fn, lib, ok=True):
                err = rel_error(fn(), layer.ref[p])
                if ok and not err <= TOL:
                    raise AssertionError(f"{name} {p} {form}: relative error {err:.2e} > {TOL}")
                gpu, b2b = timings(fn, lib, args, shared_stream)
                rows.append(dict(layer=name, p=p, form=form, gpu_ms=gpu, b2b_ms=b2b, rel_err=err))
                print(f"{name:18} {p:6} {form:10} {gpu:8.4f} {b2b:8.4f} {err:9.1e}", flush=True)
            for form in gemm.FORMS + tuple(gemm.FUSED):
                with forced(form):
                    report(form, layer.ours(gemm, p), "cupy")
            report("cudnn", layer.cudnn(p), "torch", ok=False)
            with tempfile.TemporaryDirectory() as d, config.override(gemm_tune="on", tune_cache=str(Path(d) / "t.json")):
                fn = layer.ours(gemm, p)
                fn()                                                  # tunes
                record = tuning.default_cache().get(gemm.form_key(cp, p, layer.g))
                print(f"{'':18} {p:6} tuned: {record['choice']} {record['ms']} skipped {record['skipped']}")
                rows.append(dict(layer=name, p=p, form="tuned", choice=record["choice"], record=record))
        del layer
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

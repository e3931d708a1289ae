"""Experiment (not a benchmark of record): how far fp32 training-step gradients sit from float64.

paper.py step checks our loss and weight gradients against PyTorch float64 (step_check). Its
first GPU run (session 5) flagged conv1's weight gradient of AlexNet at 2.6e-3 and OverFeat's
conv1 bias gradient at 1.4e-3, above STEP_TOL = 1e-3, while every layer's passes agree with
float64 to 1e-6 in Table 3. This asks whether that is our error or fp32's: on the same weights
and batch it measures, against float64, each of our backends and PyTorch in float32 (cuDNN and
cuBLAS strict, no TF32), parameter by parameter.

With --tf32 (session 31) the question is the TF32 mode's: OverFeat-fast's TF32 step failed its
check on an H100 and an H200 (conv1's weight gradient 2.8e-3 from float64 against a bound of
1.8e-3, twice PyTorch TF32's). Per pass, on a step's own operands at batch 128 (exp_tf32_bound
--gpu --real, H200), every backend but one is within 1.0x of a direct TF32 convolution's error;
winograd's is 2.4-2.6x in fprop and accGrad and 7.6x in bprop (2.1e-3), and auto had put
OverFeat-fast's two 1024-plane layers on winograd in all three passes. This runs the step as
paper.py step checks it (branch_errors: PyTorch takes our forward's branch at every kink), in the
TF32 mode, with auto's candidates as tuned, with winograd limited to F(2x2) (winograd_f4 off),
and without winograd, beside PyTorch TF32's own errors (the check's yardstick).

  python -m benchmarks.experiments.exp_step_error    # batch 128, as paper.py step
  python -m benchmarks.experiments.exp_step_error --tf32 --nets overfeat_fast
"""
import argparse
from pathlib import Path

from benchmarks.harness import RESULTS_DIR, provenance, step_check, torch_fp32_errors, torch_model, write_results

BACKENDS = ("gemm", "auto")  # fbfft cannot take the strided conv1 (auto puts it on polyphase)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--tf32", action="store_true", help="the TF32 mode's step, auto with and without winograd")
    ap.add_argument("--nets", default="alexnet,overfeat_fast", help="comma-separated zoo networks")
    args = ap.parse_args()
    if args.tf32:
        return tf32_study(args)

    import cupy as cp

    import minitorch_fft as mt
    from minitorch_fft import models
    from minitorch_fft.backends import cgemm, tuning
    rows = []
    for net in args.nets.split(","):
        x_np, y_np = step_batch(net, args)
        errors = {}
        for backend in BACKENDS:
            mt.manual_seed(args.seed)                   # the same initial weights for every backend
            model = models.get(net, num_classes=1000, backend=backend).to("cuda")
            with cgemm.tf32(False):
                errors[backend] = step_check(model, torch_model(net, 1000), x_np, y_np, "cuda")
        errors["torch_fp32"] = torch_fp32_errors(model, torch_model(net, 1000), x_np, y_np, "cuda")
        for name in errors["gemm"]:
            rows.append({"network": net, "tensor": name, **{k: errors[k][name] for k in errors}})
        del model
        cp.get_default_memory_pool().free_all_blocks()
    cols = [("network", "network", ""), ("tensor", "tensor", "")]
    cols += [(f"{k} err", k, ".1e") for k in BACKENDS + ("torch_fp32",)]
    meta = provenance(tuning.device_name(cp), cupy=cp.__version__, batch=args.batch, seed=args.seed)
    paths = write_results("exp_step_error", meta, rows, cols,
                          "Experiment: training-step gradients in fp32 against float64",
                          "Relative error (2-norm) against PyTorch float64 on the same weights, batch and "
                          "labels, eval mode, at initialisation: our model per backend (strict fp32 "
                          "GEMMs) and PyTorch float32 (cuDNN and cuBLAS without TF32, cudnn.benchmark off: its "
                          "heuristic algorithms).", out_dir=args.out, subdir="experiments")
    print(paths[1].read_text())


def step_batch(net, args):
    """(x, labels) of the step: a Gaussian batch and random labels, seeded by --seed."""
    import numpy as np

    from minitorch_fft import models
    shape = (args.batch,) + models.input_shape(net)
    return (np.random.default_rng(args.seed).standard_normal(shape, dtype=np.float32),
            np.random.default_rng(args.seed + 1).integers(0, 1000, args.batch))


def tf32_rows():
    """{row: settings}: auto's candidates in each TF32 row, overridden for the model's whole step."""
    from minitorch_fft.backends import auto
    return {"auto": {},
            "auto, winograd F(2x2) only": {"winograd_f4": False},
            "auto without winograd": {"auto_backends": tuple(b for b in auto.PREFERENCE if b != "winograd")}}


def tf32_study(args):
    import cupy as cp
    import torch

    import minitorch_fft as mt
    from minitorch_fft import models
    from minitorch_fft.backends import auto, config, tuning
    from benchmarks.harness import setup_cudnn
    from benchmarks.paper import TF32_STEP_CAP, branch_errors, step_verdict
    setup_cudnn(torch)                              # records PyTorch's TF32 defaults: the yardstick's mode
    rows, bounds, row_settings = [], [], tf32_rows()
    for net in args.nets.split(","):
        x_np, y_np = step_batch(net, args)
        errors, yardstick = {}, None
        for label, settings in row_settings.items():
            mt.manual_seed(args.seed)                   # the same initial weights for every row
            model = models.get(net, num_classes=1000, backend="auto").to("cuda")
            with config.override(**settings):
                errors[label], yard, flips = branch_errors(model, net, x_np, y_np, tf32=True)
            yardstick = yardstick or yard
            worst, bound, passed = step_verdict(errors[label], yard, cap=TF32_STEP_CAP)   # paper.py step's
            err = errors[label].get(worst, float("nan"))              # a broken yardstick names no tensor of ours
            bounds.append(f"{net}, {label}: worst {worst} {err:.2e}, bound {bound:.2e} "
                          f"({'passes' if passed else 'FAILS'}); {len(flips)} kinks flipped")
            print(bounds[-1], flush=True)
            del model
            cp.get_default_memory_pool().free_all_blocks()
        for name in errors["auto"]:
            rows.append({"network": net, "tensor": name, **{k: errors[k][name] for k in errors},
                         "torch_tf32": yardstick[name]})
    cols = [("network", "network", ""), ("tensor", "tensor", "")]
    cols += [(f"{k} err", k, ".1e") for k in row_settings] + [("PyTorch TF32 err", "torch_tf32", ".1e")]
    print(auto.format_choices(), flush=True)      # each row's choices, keyed apart by candidate set
    meta = provenance(tuning.device_name(cp), cupy=cp.__version__, batch=args.batch, seed=args.seed)
    paths = write_results("exp_step_error_tf32", meta, rows, cols,
                          "Experiment: the TF32 mode's step gradients against float64, with and without winograd",
                          "Relative error (2-norm) against PyTorch float64 on the same weights, batch and labels, "
                          "eval mode, at initialisation, as paper.py step checks the TF32 mode (PyTorch takes our "
                          "forward's branch at every ReLU and max-pool). Rows of auto: its tuned candidates; with "
                          "winograd_f4 off (winograd's F(2x2) only); without winograd (auto_backends). The check's "
                          "bound: twice PyTorch TF32's largest error, at least 1e-3.\n\n" + "\n".join(
                              f"- {b}" for b in bounds), out_dir=args.out, subdir="experiments")
    print(paths[1].read_text())


if __name__ == "__main__":
    main()

"""Experiment (not a benchmark of record): how far fp32 training-step gradients sit from float64.

paper.py step checks our loss and weight gradients against PyTorch float64 (step_check). Its
first GPU run (session 5) flagged conv1's weight gradient of AlexNet at 2.6e-3 and OverFeat's
conv1 bias gradient at 1.4e-3, above STEP_TOL = 1e-3, while every layer's passes agree with
float64 to 1e-6 in Table 3. This asks whether that is our error or fp32's: on the same weights
and batch it measures, against float64, each of our backends and PyTorch in float32 (cuDNN and
cuBLAS strict, no TF32), parameter by parameter.

  python -m benchmarks.experiments.exp_step_error    # batch 128, as paper.py step
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
    args = ap.parse_args()

    import cupy as cp
    import numpy as np

    import minitorch_fft as mt
    import models
    from backends import cgemm, tuning
    rows = []
    for net in ("alexnet", "overfeat_fast"):
        shape = (args.batch,) + models.input_shape(net)
        x_np = np.random.default_rng(args.seed).standard_normal(shape, dtype=np.float32)
        y_np = np.random.default_rng(args.seed + 1).integers(0, 1000, args.batch)
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


if __name__ == "__main__":
    main()

"""Benchmark: the cudnn backend (cuDNN through its Python frontend, on CuPy arrays) against
PyTorch's cuDNN on the same memory, strict fp32 and TF32, on a few layers of each zoo network;
and gemm's 1x1 path on ResNet's 1x1 layers against cuDNN strict.

Per layer and pass: median ms of
  cudnn_strict   backends.cudnn, tf32 setting off (its first call searches cuDNN's plans)
  cudnn_tf32     backends.cudnn, tf32 setting on
  torch_strict   PyTorch's cuDNN, allow_tf32 off, benchmark mode over every algorithm
  torch_tf32     PyTorch's cuDNN in its default TF32 mode
  gemm           backends.gemm (1x1 layers only: the GEMM-only path)
each checked against float64 first; timings are CUDA events around INNER back-to-back calls
(per call), after warm-up. Ratios are torch's time over ours (>= 1.0: ours as fast or faster).
"first call s" is the first call's wall time: for ours the engine search, for PyTorch its
benchmark-mode search.

Host time of one call, strict (median of HOST_REPEAT): "idle" with the device synchronised before
each call (what the call costs the host: argument checks, plan look-up, allocation, launch);
"b2b" back to back, nothing synchronised (the method of the first run, cb9409a: on multi-ms
passes the launch queue fills and it becomes the GPU's time). For ours also the chosen plan's
execute alone, idle, output preallocated: through the pointer form the backend calls, and through
the frontend's public execute_plan_at_index (the call before the pointer form).

  python -m benchmarks.bench_cudnn                     # every layer, every implementation
  python -m benchmarks.bench_cudnn --impls cudnn_strict torch_strict   # the strict target only
  python -m benchmarks.bench_cudnn --layers resnet50.1x1.1024-256 --repeat 20

Writes results/<device>/bench_cudnn.json and .md (--out for another folder) after every layer.
Exit status 1 if a check failed or cuDNN's frontend is not usable.
"""
import argparse
import sys
import time
import traceback

from minitorch_fft.backends import config
from benchmarks.harness import (PASSES, RESULTS_DIR, median_ms, provenance, reference64, rel_error, set_tf32,
                                setup_cudnn, write_results)

# -- defaults --------------------------------------------------------------------------------
WARMUP = 3
REPEAT = 10
SEED = 0
INNER = 5   # back-to-back calls per timed span: launches queue up, as in training
HOST_REPEAT = 50
# name: (batch, f, f', h = w, k, stride, padding)
LAYERS = {
    "resnet18.1x1.64-128.s2": (128, 64, 128, 56, 1, 2, 0),     # layer2's shortcut
    "resnet50.1x1.256-512.s2": (128, 256, 512, 56, 1, 2, 0),   # layer2's shortcut
    "resnet50.1x1.256-64": (128, 256, 64, 56, 1, 1, 0),
    "resnet50.1x1.64-256": (128, 64, 256, 56, 1, 1, 0),
    "resnet50.1x1.1024-256": (128, 1024, 256, 14, 1, 1, 0),
    "resnet50.3x3.64": (128, 64, 64, 56, 3, 1, 1),
    "resnet50.3x3.128.s2": (128, 128, 128, 56, 3, 2, 1),       # layer2's first 3x3 (torchvision v1.5)
    "resnet50.3x3.256": (128, 256, 256, 14, 3, 1, 1),
    "vgg16.conv5_2": (64, 512, 512, 14, 3, 1, 1),
    "vgg16.conv4_2": (64, 512, 512, 28, 3, 1, 1),
    "alexnet.conv2": (128, 64, 192, 27, 5, 1, 2),
    "vgg16.conv1_2": (64, 64, 64, 224, 3, 1, 1),
}
IMPLS = ("cudnn_strict", "cudnn_tf32", "torch_strict", "torch_tf32", "gemm")
TOLERANCE = {"cudnn_strict": 1e-4, "cudnn_tf32": 1e-2, "torch_strict": 1e-4, "torch_tf32": 1e-2, "gemm": 1e-4}   # harness.TOLERANCE


def log(*a):
    print(*a, flush=True)


def gpu_ms(fn, lib, args):
    return median_ms(lambda: [fn() for _ in range(INNER)], lib, args.warmup, args.repeat) / INNER


def bench_layer(name, args):
    import cupy as cp
    import torch

    from minitorch_fft.backends import cudnn, gemm
    from minitorch_fft.backends.common import geometry

    S, f, fo, hw, k, s, p = LAYERS[name]
    stride, pad = (s, s), (p, p)
    g = geometry((S, f, hw, hw), (fo, f, k, k), stride, pad)
    rng = cp.random.default_rng(args.seed + list(LAYERS).index(name))
    x, w = rng.standard_normal((S, f, hw, hw), dtype=cp.float32), rng.standard_normal((fo, f, k, k), dtype=cp.float32)
    gy = rng.standard_normal((S, fo, g.oh, g.ow), dtype=cp.float32)
    xt, wt, gyt = (torch.from_dlpack(a) for a in (x, w, gy))         # the same memory, no copy
    ref = reference64(x, w, gy, stride, pad)

    def ours(backend):
        return {"fprop": lambda: backend.fprop(x, w, stride, pad),
                "bprop": lambda: backend.bprop(gy, w, x.shape, stride, pad),
                "accgrad": lambda: backend.accgrad(gy, x, w.shape, stride, pad)}

    def conv_backward(mask):
        return torch.ops.aten.convolution_backward(gyt, xt, wt, None, stride, pad, (1, 1), False, (0, 0), 1, mask)
    theirs = {"fprop": lambda: torch.nn.functional.conv2d(xt, wt, stride=stride, padding=pad),
              "bprop": lambda: conv_backward((True, False, False))[0],
              "accgrad": lambda: conv_backward((False, True, False))[1]}
    runs = {"cudnn_strict": (ours(cudnn), "cupy", False), "cudnn_tf32": (ours(cudnn), "cupy", True),
            "torch_strict": (theirs, "torch", False), "torch_tf32": (theirs, "torch", True),
            "gemm": (ours(gemm), "cupy", False)}
    impls = [i for i in args.impls if i != "gemm" or k == 1]
    rows = {pn: {"layer": name, "pass": pn, "S": S, "f": f, "fo": fo, "h": hw, "k": k, "stride": s, "pad": p}
            for pn in PASSES}
    for impl in impls:
        fns, lib, tf32 = runs[impl]
        set_tf32("tf32" if tf32 else "strict")
        with config.override(tf32=tf32):
            for pn in PASSES:
                row = rows[pn]
                try:
                    start = time.perf_counter()
                    got = fns[pn]()                          # cudnn searches its plans on this first call
                    torch.cuda.synchronize()
                    row[f"first_call_s_{impl}"] = round(time.perf_counter() - start, 3)
                    row[f"err_{impl}"] = rel_error(got, ref[pn])
                    row[f"ok_{impl}"] = row[f"err_{impl}"] <= TOLERANCE[impl]
                    del got
                    row[f"ms_{impl}"] = gpu_ms(fns[pn], lib, args)
                    if impl in ("cudnn_strict", "torch_strict"):
                        row[f"host_us_{impl}"] = 1e3 * median_ms(fns[pn], "cpu", 3, HOST_REPEAT,
                                                                 before=torch.cuda.synchronize)
                        row[f"host_b2b_us_{impl}"] = 1e3 * median_ms(fns[pn], "cpu", 3, HOST_REPEAT)
                        torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - one failure must not hide the other results
                    row[f"error_{impl}"] = f"{type(e).__name__}: {e}"[:300]
                    row[f"ok_{impl}"] = False
                    log(f"  ERROR {name} {impl} {pn}: {row[f'error_{impl}']}")
                    traceback.print_exc()
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    set_tf32("strict")
    for pn, row in rows.items():
        row.update(_execute_only_us(cudnn, g, pn, x, w, gy))
        for mode in ("strict", "tf32"):
            if row.get(f"ms_cudnn_{mode}") and row.get(f"ms_torch_{mode}"):
                row[f"x_{mode}"] = row[f"ms_torch_{mode}"] / row[f"ms_cudnn_{mode}"]
        if row.get("ms_gemm") and row.get("ms_torch_strict"):
            row["x_gemm"] = row["ms_torch_strict"] / row["ms_gemm"]
        chosen = {key[3]: plan for key, (plan, _) in cudnn.built().items() if key[1] == pn and key[2] == g
                  and key[-1] == "nchw"}
        row["plan_strict"], row["plan_tf32"] = chosen.get("fp32"), chosen.get("tf32")
        log(f"{name:<26}{pn:<8} cudnn {row.get('ms_cudnn_strict', float('nan')):8.3f} / "
            f"{row.get('ms_cudnn_tf32', float('nan')):8.3f} ms, torch {row.get('ms_torch_strict', float('nan')):8.3f} / "
            f"{row.get('ms_torch_tf32', float('nan')):8.3f} ms, x {row.get('x_strict', float('nan')):.3f} / "
            f"{row.get('x_tf32', float('nan')):.3f}" + (f", gemm {row['ms_gemm']:.3f} ms x {row['x_gemm']:.3f}"
                                                         if row.get("x_gemm") else ""))
    return list(rows.values())


def _execute_only_us(cudnn, g, pass_name, x, w, gy):
    """Host microseconds of the strict plan's execute alone, device idle, output preallocated:
    through the pointer form (what a call runs) and through the frontend's public execute."""
    import cupy as cp
    plan = next((p for key, p in cudnn._built.items() if key[1] == pass_name and key[2] == g and key[3] == "fp32"
                 and key[-1] == "nchw"),
                None)
    if plan is None:
        return {}
    a, b, shape = {"fprop": (x, w, (g.S, g.fo, g.oh, g.ow)), "bprop": (gy, w, (g.S, g.f, g.h, g.w)),
                   "accgrad": (x, gy, (g.fo, g.f, g.kh, g.kw))}[pass_name]
    out = cp.empty(shape, dtype=cp.float32)
    sync = cp.cuda.Device().synchronize
    us = {"host_us_execute": 1e3 * median_ms(lambda: plan.run(cp, a, b, out), "cpu", 3, HOST_REPEAT, before=sync),
          "host_us_public": 1e3 * median_ms(lambda: plan.run_public(cp, a, b, out), "cpu", 3, HOST_REPEAT,
                                            before=sync),
          "pointer_form": plan.pointer_form is not None}
    sync()
    return us


COLUMNS = [("layer", "layer", ""), ("pass", "pass", ""), ("cudnn strict ms", "ms_cudnn_strict", ".3f"),
           ("torch strict ms", "ms_torch_strict", ".3f"), ("x strict", "x_strict", ".3f"),
           ("cudnn tf32 ms", "ms_cudnn_tf32", ".3f"), ("torch tf32 ms", "ms_torch_tf32", ".3f"),
           ("x tf32", "x_tf32", ".3f"), ("gemm ms", "ms_gemm", ".3f"), ("x gemm", "x_gemm", ".3f"),
           ("host us ours", "host_us_cudnn_strict", ".1f"), ("of it execute", "host_us_execute", ".1f"),
           ("public execute us", "host_us_public", ".1f"), ("host us torch", "host_us_torch_strict", ".1f"),
           ("b2b us ours", "host_b2b_us_cudnn_strict", ".1f"), ("b2b us torch", "host_b2b_us_torch_strict", ".1f"),
           ("first call s ours", "first_call_s_cudnn_strict", ".2f"),
           ("first call s torch", "first_call_s_torch_strict", ".2f"), ("plan strict", "plan_strict", ""),
           ("err strict", "err_cudnn_strict", ".1e"), ("err torch strict", "err_torch_strict", ".1e"),
           ("err tf32", "err_cudnn_tf32", ".1e")]
NOTES = """x = PyTorch's time / ours (>= 1: ours as fast). "x gemm" = cuDNN strict / gemm's 1x1 path.
Host us: one call's host time with the device idle (synchronised before each call); "of it
execute": the chosen plan's execute alone through the pointer form the backend calls; "public
execute": the same plan through the frontend's execute_plan_at_index; "b2b": calls back to back,
nothing synchronised (the first run's method). "first call s": the first call's wall time (ours:
the engine search; torch: its benchmark search). Errors: relative, against float64."""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    ap.add_argument("--warmup", type=int, default=WARMUP)
    ap.add_argument("--repeat", type=int, default=REPEAT)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args(argv)

    import cupy as cp
    import torch

    from minitorch_fft.backends import cudnn, tuning
    if not cudnn.available():
        log(f"cuDNN's frontend is not usable: {cudnn._frontend()[1]}")
        return 1
    meta = provenance(tuning.device_name(cp), cupy=cp.__version__, torch=torch.__version__,
                      torch_cudnn=torch.backends.cudnn.version(), **{f"cudnn_{k}": v for k, v in cudnn.versions().items()},
                      **setup_cudnn(torch), cudnn_workspace_mb=config.get("cudnn_workspace_mb"),
                      warmup=args.warmup, repeat=args.repeat, inner=INNER, impls=args.impls)
    log(meta)
    rows = []
    for name in args.layers:
        rows += bench_layer(name, args)
        # after every layer: a run cut short keeps what it measured
        write_results("bench_cudnn", meta, rows, COLUMNS, "The cudnn backend against PyTorch's cuDNN", notes=NOTES,
                      out_dir=args.out)
    summary(rows)
    failed = [(r["layer"], r["pass"], i) for r in rows for i in IMPLS if r.get(f"ok_{i}") is False]
    if failed:
        log(f"FAILED checks: {failed}")
    return 1 if failed else 0


def summary(rows):
    """The strict comparison, one line per layer and pass, and its worst ratio (printed last)."""
    log(f"{'layer':<26}{'pass':<8}{'ours ms':>9}{'torch ms':>9}{'x':>7}{'host us':>9}{'torch us':>9}"
        f"{'exec us':>8}{'public':>8}{'search s':>9}")
    for r in rows:
        log(f"{r['layer']:<26}{r['pass']:<8}{r.get('ms_cudnn_strict', float('nan')):9.3f}"
            f"{r.get('ms_torch_strict', float('nan')):9.3f}{r.get('x_strict', float('nan')):7.3f}"
            f"{r.get('host_us_cudnn_strict', float('nan')):9.1f}{r.get('host_us_torch_strict', float('nan')):9.1f}"
            f"{r.get('host_us_execute', float('nan')):8.1f}{r.get('host_us_public', float('nan')):8.1f}"
            f"{r.get('first_call_s_cudnn_strict', float('nan')):9.2f}")
    ratios = [(r["x_strict"], r["layer"], r["pass"]) for r in rows if r.get("x_strict")]
    if ratios:
        log(f"worst strict ratio {min(ratios)[0]:.3f} ({min(ratios)[1]} {min(ratios)[2]}); "
            f"{sum(x >= 0.97 for x, _, _ in ratios)} of {len(ratios)} at >= 0.97")


if __name__ == "__main__":
    sys.exit(main())

"""Experiment: which cuDNN plans of a 3x3 fprop lose a NaN of their input (session 55).

test_errors.py::test_nan_and_inf_propagate[cuda] fails now and then: the digits net, fed an image
with a NaN and an inf, gives a finite output. Session 55's failure said where the NaN went: conv2
(16 -> 32, 3x3, pad 1) on the cudnn backend gave no NaN for an input with 144. This builds every
plan the cudnn backend's search lists for three small fprops (heuristics A, B, the fallback list
and every other engine, strict fp32 notes filter) and runs each on an input with NaN in a 3x3
block of every plane of image 0, through the public execute and the pointer form. A plan that
propagates gives NaN in exactly the outputs the block reaches, or (an FFT engine) in all of them;
one that gives fewer is flagged. (Session 55's log, experiments/nan_engines_efe926e.log, came from the
first version, which flagged the FFT engines' spread too and printed no "all N" count.)

  PYTHONPATH=. python3 benchmarks/experiments/exp_cudnn_nan_plans.py
"""
import numpy as np


def main():
    import cupy as cp

    from minitorch_fft.backends import cudnn as C
    from minitorch_fft.backends.common import geometry
    cudnn, why = C._frontend()
    if cudnn is None:
        raise SystemExit(f"cuDNN is not usable here: {why}")
    handle = C._handle(cp, cudnn)
    rng = np.random.default_rng(0)
    print(C.versions())
    for xs, ws in [((1, 16, 8, 8), (32, 16, 3, 3)), ((1, 1, 8, 8), (16, 1, 3, 3)), ((16, 8, 8, 8), (16, 8, 3, 3))]:
        g = geometry(xs, ws, (1, 1), (1, 1))
        x = rng.standard_normal(xs).astype(np.float32)
        w = rng.standard_normal(ws).astype(np.float32)
        xn = x.copy()
        xn[0, :, 1:4, 1:4] = np.nan                 # NaN at 9 positions of every plane of image 0
        reach = np.zeros(xs[2:], bool)
        reach[0:5, 0:5] = True                      # 3x3, pad 1: the outputs within a pixel of a NaN
        expect = int(reach.sum()) * ws[0]
        a, an, b = cp.asarray(x), cp.asarray(xn), cp.asarray(w)
        out_shape = (xs[0], ws[0], xs[2], xs[3])
        graph, uids = C._planned_graph(cudnn, handle, "fprop", g, "fp32", 1 << 30, C.HEURISTICS, every_engine=True)
        ref = None
        print(f"== fprop x {xs} w {ws}: NaN expected in {expect} outputs of image 0 "
              f"(all {out_shape[1] * xs[2] * xs[3]} where the NaN spreads)")
        for name, idx in C._plan_indices(graph).items():
            try:
                plan = C._build(cudnn, handle, graph, uids, idx, 1 << 30)
            except Exception:  # noqa: BLE001 - a plan that does not build is no candidate either
                continue
            clean = plan.run_public(cp, a, b, cp.empty(out_shape, cp.float32)).get()
            if ref is None:
                ref = clean
            err = float(np.abs(clean - ref).max() / np.abs(ref).max())
            pub = plan.run_public(cp, an, b, cp.full(out_shape, 7.0, cp.float32)).get()
            ptr = None
            if plan.pointer_form is not None:
                ptr = plan.run(cp, an, b, cp.full(out_shape, 7.0, cp.float32)).get()
            n_pub = int(np.isnan(pub[0]).sum())
            n_ptr = None if ptr is None else int(np.isnan(ptr[0]).sum())
            lost = [n for n in (n_pub, n_ptr) if n is not None and n < expect]
            flag = "   <-- NaN lost" if lost else ""   # more than expected: an FFT engine spreads it (allowed)
            print(f"  {name:40s} ws {plan.workspace:9d}  clean err vs first {err:.1e}  NaN public {n_pub:4d} "
                  f"pointer {n_ptr}{flag}")


if __name__ == "__main__":
    main()

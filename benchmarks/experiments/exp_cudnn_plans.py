"""Experiment: every cuDNN plan of one layer-pass, timed, checked and sized, beside PyTorch strict.

For a layer-pass where the cudnn backend loses to PyTorch's strict cuDNN (bench_cudnn), this lists
every plan the backend's search considers (heuristics A, B, the fallback list, every other engine
at its default knobs; strict fp32 notes filter) with no workspace bound: its workspace, its
relative difference from gemm, its median time over a few runs on fresh random data, and whether
the search would take it (within CHECK_TOL and within cudnn_workspace_mb). Then the backend's own
choice and PyTorch strict's time on the same memory (benchmark mode, TF32 off). The question it
answers: is PyTorch's speed a plan we refuse (workspace, check), one we never list, or host time?

  PYTHONPATH=. python3 benchmarks/experiments/exp_cudnn_plans.py --layer vgg16.conv1_2 --pass accgrad
  PYTHONPATH=. python3 benchmarks/experiments/exp_cudnn_plans.py --layer resnet18.1x1.64-128.s2 --pass bprop
  PYTHONPATH=. python3 benchmarks/experiments/exp_cudnn_plans.py --geometry 128,128,512,28,1,1,0 --pass fprop --tf32

--geometry S,f,f',hw,k,stride,pad names a layer outside bench_cudnn's LAYERS; --tf32 lists the plans
of the framework's TF32 mode (TENSOR_CORE engines admitted, checked to cgemm.TF32_TOL) beside
PyTorch's cuDNN TF32 (session 22: ResNet-50's conv14 fprop, 0.966x in table3).

--searches N then runs the backend's own search (cudnn._search, the recipe auto's cache records) N
times in this process, each on fresh random data, and prints each search's choice and its times
of the plans that were fastest in any search (session 41: VGG-16 conv11's TF32 fprop, where the
cached searches timed the same plan at 0.200-0.239 ms and kept one 4.5 % slower than the best).

--flips N then asks what moves a plan between two speeds (session 41: VGG-16 conv11's eng67_k2=0 took
0.199 ms in two searches and 0.230 in two others, steady within each): for the three fastest plans
of the listing, N timings of the same built plan on fresh copies of the operands at other
addresses (a spacer of random size allocated before each copy), then N timings of the plan built
anew each time on the same operands. If the address moves it, the first table splits; if the
build does, the second.
"""
import argparse
import json
import sys

import numpy as np

from benchmarks.bench_cudnn import LAYERS
from benchmarks.harness import median_ms

UNBOUNDED = 1 << 40
SLOW = 5   # a plan whose first two runs are over 5x the best median so far is not timed again (the
# second run, since a first run can pay a one-time cost: OverFeat-fast conv1's bprop, session 33)


def kernel_names(torch, fn):
    """The distinct GPU kernels one call of fn launches, as torch.profiler names them (it sees
    every kernel of the process, cuDNN's through the frontend included)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:90] for e in prof.events() if e.device_type.name == "CUDA"})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--layer", choices=list(LAYERS))
    where.add_argument("--geometry", help="S,f,f',hw,k,stride,pad")
    ap.add_argument("--tf32", action="store_true")
    ap.add_argument("--pass", dest="pass_name", required=True, choices=["fprop", "bprop", "accgrad"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="list the GPU kernels of PyTorch's call and of the N fastest plans (torch.profiler)")
    ap.add_argument("--searches", type=int, default=0, metavar="N",
                    help="run the backend's search N times on fresh data; each one's choice and times")
    ap.add_argument("--flips", type=int, default=0, metavar="N",
                    help="time the three fastest plans N times at other operand addresses, then N times rebuilt")
    args = ap.parse_args(argv)

    import cupy as cp
    import torch

    from minitorch_fft.backends import cgemm, config, cudnn, tuning
    from minitorch_fft.backends.common import geometry

    if args.geometry:
        args.layer = args.geometry
        S, f, fo, hw, k, s, p = (int(v) for v in args.geometry.split(","))
    else:
        S, f, fo, hw, k, s, p = LAYERS[args.layer]
    math, tol = ("tf32", cgemm.TF32_TOL) if args.tf32 else ("fp32", cudnn.CHECK_TOL)
    stride, pad = (s, s), (p, p)
    g = geometry((S, f, hw, hw), (fo, f, k, k), stride, pad)
    rng = cp.random.default_rng(7)
    x, w = rng.standard_normal((S, f, hw, hw), dtype=cp.float32), rng.standard_normal((fo, f, k, k), dtype=cp.float32)
    gy = rng.standard_normal((S, fo, g.oh, g.ow), dtype=cp.float32)
    a, b, out_shape = {"fprop": (x, w, (S, fo, g.oh, g.ow)), "bprop": (gy, w, (S, f, hw, hw)),
                       "accgrad": (x, gy, (fo, f, k, k))}[args.pass_name]
    front, why = cudnn._frontend()
    if front is None:
        sys.exit(f"cuDNN frontend not usable: {why}")
    handle = cudnn._handle(cp, front)
    reference = cudnn._reference(args.pass_name, g, a, b)
    limit = config.mib_bytes("cudnn_workspace_mb")
    graph, uids = cudnn._planned_graph(front, handle, args.pass_name, g, math, UNBOUNDED, cudnn.HEURISTICS,
                                       every_engine=True)
    rows, best, plans = [], [float("inf")], {}
    for name, index in cudnn._plan_indices(graph).items():
        row = {"plan": name}
        try:
            plan = cudnn._build(front, handle, graph, uids, index, UNBOUNDED)
        except Exception as e:  # noqa: BLE001 - deselected or unbuildable: say which
            row["build"] = f"{type(e).__name__}: {e}"[:80]
            rows.append(row)
            continue
        out = cp.empty(out_shape, dtype=np.float32)
        row["workspace_mib"] = round(plan.workspace / 2**20, 1)
        try:
            first = median_ms(lambda: plan.run(cp, a, b, out), "cupy", 0, 1)   # module load included
            row["first_ms"] = first
            row["err"] = float(tuning.rel_error(cp, out, reference))
            if first > SLOW * best[0]:   # a one-time cost (module load) or a slow plan: run it again
                first = median_ms(lambda: plan.run(cp, a, b, out), "cupy", 0, 1)
                row["second_ms"] = first
            if first > SLOW * best[0]:   # cannot win: its second run is its figure, not `repeat`
                row["ms"], row["build"] = first, "two runs only (slow)"
            else:
                row["ms"] = median_ms(lambda: plan.run(cp, a, b, out), "cupy", 1, args.repeat)
                best[0] = min(best[0], row["ms"])
        except Exception as e:  # noqa: BLE001
            row["build"] = f"run failed: {type(e).__name__}: {e}"[:80]
        row["searchable"] = (plan.workspace <= limit and row.get("err", 1.0) <= tol)
        rows.append(row)
        plans[name] = plan
        del out

    fn = {"fprop": cudnn.fprop, "bprop": cudnn.bprop, "accgrad": cudnn.accgrad}[args.pass_name]
    call = {"fprop": lambda: fn(x, w, stride, pad), "bprop": lambda: fn(gy, w, x.shape, stride, pad),
            "accgrad": lambda: fn(gy, x, w.shape, stride, pad)}[args.pass_name]
    with config.override(tf32=args.tf32):
        call()
        chosen = cudnn.built().get(cudnn._plan_key(cp, args.pass_name, g))
        ours_ms = median_ms(call, "cupy", 2, args.repeat * 2)

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    xt, wt, gyt = (torch.from_dlpack(t) for t in (x, w, gy))

    def torch_call():
        if args.pass_name == "fprop":
            return torch.nn.functional.conv2d(xt, wt, stride=stride, padding=pad)
        mask = (True, False, False) if args.pass_name == "bprop" else (False, True, False)
        return torch.ops.aten.convolution_backward(gyt, xt, wt, None, stride, pad, (1, 1), False, (0, 0), 1, mask)
    torch_call()
    torch_ms = median_ms(torch_call, "torch", 2, args.repeat * 2)

    rows.sort(key=lambda r: r.get("ms", float("inf")))
    print(f"# {args.layer} {args.pass_name}: ours (cudnn backend, chosen {chosen}) {ours_ms:.3f} ms, "
          f"PyTorch {'TF32' if args.tf32 else 'strict'} {torch_ms:.3f} ms, ratio {torch_ms / ours_ms:.3f}; workspace bound {limit / 2**20:.0f} MiB")
    print("| plan | ms | first run ms | second run ms | rel err vs gemm | workspace MiB | our search may take it | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms, first, second = (f"{r[k]:.3f}" if k in r else "" for k in ("ms", "first_ms", "second_ms"))
        err = f"{r['err']:.1e}" if "err" in r else ""
        print(f"| {r['plan']} | {ms} | {first} | {second} | {err} | {r.get('workspace_mib', '')} | "
              f"{r.get('searchable', '')} | {r.get('build', '')} |")
    if args.kernels:   # which plan is PyTorch's: the kernels it launches, beside the fastest plans'
        out = cp.empty(out_shape, dtype=np.float32)
        print(f"\nPyTorch's kernels: {kernel_names(torch, torch_call)}")
        for r in [r for r in rows if "ms" in r][:args.kernels]:
            print(f"{r['plan']}'s kernels: {kernel_names(torch, lambda: plans[r['plan']].run(cp, a, b, out))}")
    flips = address_or_build(cp, cudnn, front, handle, args.pass_name, g, math, [plans[r["plan"]] for r in rows
                             if "ms" in r][:3], args.flips, (a, b, out_shape), args.repeat) if args.flips else {}
    searches = repeated_searches(cp, cudnn, front, handle, args.pass_name, g, math, limit, args.searches, rng,
                                 (a.shape, b.shape, out_shape))
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps({"layer": args.layer, "pass": args.pass_name, "tf32": args.tf32, "ours_ms": ours_ms,
                                 "torch_ms": torch_ms, "chosen": chosen, "plans": rows, "searches": searches,
                                 "flips": flips}) + "\n")


def address_or_build(cp, cudnn, front, handle, pass_name, g, math, plans, n, operands, repeat):
    """{"address": [...], "build": [...]}: n rows each of the plans' median ms (repeat runs), first
    the same built plans on fresh copies of the operands, each copy placed after a spacer of random
    size (the rows give the copies' addresses modulo 2 MiB, in KiB), then the plans rebuilt each row
    (cudnn._replay of their choice, no workspace bound) on the original operands; printed as tables."""
    a, b, out_shape = operands
    pick = np.random.default_rng(11)
    names = [p.name for p in plans]
    address_rows, build_rows, kept = [], [], []
    for _ in range(n):
        kept.append(cp.empty(int(pick.integers(1, 1 << 16)) * 256, dtype=np.uint8))   # shifts what follows
        a2, b2, out = cp.array(a), cp.array(b), cp.empty(out_shape, dtype=np.float32)
        kept += [a2, b2, out]
        ms = [median_ms(lambda: p.run(cp, a2, b2, out), "cupy", 1, repeat) for p in plans]
        address_rows.append({"at_kib": [(v.data.ptr % (2 << 20)) // 1024 for v in (a2, b2, out)], "ms": ms})
    del kept
    out = cp.empty(out_shape, dtype=np.float32)
    for _ in range(n):
        rebuilt = [cudnn._replay(front, handle, pass_name, g, math, UNBOUNDED, p.choice) for p in plans]
        build_rows.append({"ms": [median_ms(lambda: p.run(cp, a, b, out), "cupy", 1, repeat) for p in rebuilt]})
    print(f"\nthe same built plans on {n} copies of the operands at other addresses (ms, medians of {repeat}; "
          "a, b, out at KiB modulo 2 MiB):")
    print("| copy | a, b, out KiB | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names))
    for i, r in enumerate(address_rows, 1):
        print(f"| {i} | {r['at_kib']} | " + " | ".join(f"{v:.4f}" for v in r["ms"]) + " |")
    print(f"\nthe plans built anew {n} times, on the original operands (ms, medians of {repeat}):")
    print("| build | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for i, r in enumerate(build_rows, 1):
        print(f"| {i} | " + " | ".join(f"{v:.4f}" for v in r["ms"]) + " |")
    return {"plans": names, "address": address_rows, "build": build_rows}


def repeated_searches(cp, cudnn, front, handle, pass_name, g, math, limit, n, rng, shapes):
    """n runs of the backend's search (cudnn._search), each on fresh random operands; prints each
    one's choice and its times of the plans that were among the three fastest of any search."""
    if n < 1:
        return []
    a_shape, b_shape, out_shape = shapes
    records = []
    for _ in range(n):
        a = rng.standard_normal(a_shape, dtype=cp.float32)
        b = rng.standard_normal(b_shape, dtype=cp.float32)
        record = cudnn._search(cp, front, handle, pass_name, g, math, limit, a, b, out_shape)
        records.append({"choice": record["choice"]["name"], "ms": record["ms"]})
    shown = sorted({name for r in records for name in sorted(r["ms"], key=r["ms"].get)[:3]})
    print(f"\n{n} searches (cudnn._search, fresh data each): each one's choice, and its ms of the plans "
          f"among the three fastest of any search")
    print("| search | choice | " + " | ".join(shown) + " |")
    print("|---|---|" + "---|" * len(shown))
    for i, r in enumerate(records, 1):
        print(f"| {i} | {r['choice']} | " + " | ".join(f"{r['ms'].get(name, float('nan')):.4f}" for name in shown) + " |")
    return records


if __name__ == "__main__":
    main()

"""Experiment: where a training step's GPU memory goes at its peak, by category.

One step (forward, backward, SGD with momentum) of a zoo network, after two warm-up steps (tuning,
momentum, plans and scratch made). A CuPy MemoryHook follows every allocation the pools hand out
and take back (pass 1), and finds the step's peak of live bytes and the allocation that makes
it. Pass 2 runs the same step again and, right after that allocation, asks who holds each live
block: the weights, their gradients, the momentum, the input batch, the spectra that
reuse_spectra() keeps across passes, what the backends and the framework keep in module-level
caches (cufft's scratch buffers and plans' work areas, random states), the arrays that graph
Functions saved for backward (by Function), Tensors still alive (intermediate outputs the graph
or the caller keeps), and the rest by the call site that allocated it (in-flight temporaries:
im2col columns, the gradient being propagated). Memory outside CuPy's pools (the workspace
cuBLAS makes for itself on CuPy's handle, the CUDA context) is not in these numbers; PyTorch's
cuBLAS and cuDNN workspaces come from its caching allocator, so they are in its numbers.

--torch adds PyTorch strict's step (torchvision's model, cuDNN benchmark mode over every algorithm,
TF32 off) on the same batch: max_memory_allocated and max_memory_reserved, as benchmarks.paper
measures it. Prints the step's median time of 5 too. Uses only names that main's tree at d5dc4e6
has, so two trees compare side by side (run from the tree measured, or with it on PYTHONPATH):

  PYTHONPATH=. python3 benchmarks/experiments/exp_step_memory.py --net alexnet --batch 128 --torch
  PYTHONPATH=OLD python3 benchmarks/experiments/exp_step_memory.py --net resnet50 --batch 64
"""
import argparse
import gc
import json
import sys
import traceback
from pathlib import Path

import cupy as cp
import numpy as np

import minitorch_fft as mt
try:
    from minitorch_fft import backends, models
except ImportError:   # a tree from before session 52 (gpu_step_memory.sh's BASE): top-level packages
    import backends
    import models

GIB = 2.0**30
TREE_DIRS = ("minitorch_fft", "backends", "models")


def call_site(frame):
    """'dir/file.py:function' of the innermost frame inside the measured tree."""
    while frame is not None:
        parts = Path(frame.f_code.co_filename).parts
        if len(parts) >= 2 and parts[-2] in TREE_DIRS:
            return f"{parts[-2]}/{parts[-1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "outside the tree"


def phase(frame):
    """forward, backward or update: which part of the step the frame is in."""
    names = set()
    while frame is not None:
        names.add((Path(frame.f_code.co_filename).name, frame.f_code.co_name))
        frame = frame.f_back
    if ("optim.py", "step") in names:
        return "update"
    return "backward" if ("tensor.py", "backward") in names else "forward"


class Ledger(cp.cuda.MemoryHook):
    """Live bytes of the pools, allocation by allocation: the peak, the allocation that made it
    (its number, call site and phase), and at allocation number `stop_at` a call of on_stop()."""

    name = "exp_step_memory"

    def __init__(self, live, stop_at=None, on_stop=None):
        self.live = self.peak = self.before = live
        self.count = self.peak_count = 0
        self.blocks = {}             # pointer -> (bytes, call site), allocated inside the block
        self.peak_site = self.peak_phase = ""
        self.stop_at, self.on_stop = stop_at, on_stop

    def malloc_postprocess(self, mem_ptr, mem_size, **_):
        if not mem_ptr:
            return
        frame = sys._getframe(1)    # the Python code that asked CuPy for memory
        self.count += 1
        self.blocks[mem_ptr] = (mem_size, call_site(frame))
        self.live += mem_size
        if self.live > self.peak:
            self.peak, self.peak_count = self.live, self.count
            self.peak_site, self.peak_phase = self.blocks[mem_ptr][1], phase(frame)
        if self.count == self.stop_at:
            self.on_stop(self)

    def free_postprocess(self, mem_ptr, mem_size, **_):
        self.live -= self.blocks.pop(mem_ptr, (mem_size, None))[0]


def memories(obj, depth=3):
    """The device allocations (CuPy's memory objects) that obj holds: an array, a memory pointer,
    a cuFFT plan's work area, or these inside tuples, lists and dicts, `depth` levels down."""
    if isinstance(obj, cp.ndarray):
        yield obj.data.mem
    elif isinstance(obj, cp.cuda.MemoryPointer):
        yield obj.mem
    elif depth and isinstance(obj, (tuple, list)):
        for v in obj:
            yield from memories(v, depth - 1)
    elif depth and isinstance(obj, dict):
        for v in obj.values():
            yield from memories(v, depth - 1)
    elif getattr(obj, "work_area", None) is not None:       # a cuFFT plan
        yield from memories(obj.work_area, 0)


def owners(model, opt, batch):
    """[(category, object holding device memory)] in order of precedence: a block is counted
    under the first category that holds it."""
    params = model.parameters()
    found = [("weights and buffers", [p.data for p in params] + [b.data for b in model.buffers()]),
             ("gradients", [p.grad for p in params]),
             ("momentum", list(opt.velocity)),
             ("input batch and targets", list(batch))]
    cache = backends.reuse.active()
    if cache is not None:
        found.append(("spectra kept across passes (reuse_spectra)", [e[1] for e in cache._entries.values()]))
    for name, module in sorted(sys.modules.items()):
        if name.split(".")[0] in ("backends", "minitorch_fft") and module is not None:   # backends: an old tree
            for var, value in vars(module).items():
                if isinstance(value, (dict, list)) and not var.startswith("__"):
                    found.append((f"kept by {name}.{var}", value))
    objects = gc.get_objects()
    graph = ("parents", "input_shapes", "needs_input_grad")
    for obj in objects:
        if isinstance(obj, mt.tensor.Function):
            found.append((f"saved for backward by {type(obj).__name__}",
                          [v for k, v in vars(obj).items() if k not in graph]))
    found.append(("Tensors alive: outputs the graph or the caller holds",
                  [o.data for o in objects if isinstance(o, mt.Tensor)]))
    return found


def breakdown(ledger, model, opt, batch):
    """{category: bytes} of everything live now (the peak): each block under the first owner that
    holds it; blocks nobody holds under 'temporary, allocated at <call site>'."""
    seen, out = set(), {}
    for category, held in owners(model, opt, batch):
        for mem in memories(held):
            if mem.ptr and mem.ptr not in seen:
                seen.add(mem.ptr)
                out[category] = out.get(category, 0) + mem.size
    unowned_before = ledger.live - sum(out.values())
    for ptr, (size, site) in list(ledger.blocks.items()):
        if ptr not in seen:
            out[f"temporary, allocated at {site}"] = out.get(f"temporary, allocated at {site}", 0) + size
            unowned_before -= size
    if unowned_before:
        out["held before the step, owner not found"] = unowned_before
    return out


def our_step(net, batch, backend):
    """The breakdown of our step's peak, the peak, the reserved pool size, and the peak's place."""
    mt.manual_seed(0)
    model = models.get(net, num_classes=1000, backend=backend).to("cuda")
    opt = mt.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    crit = mt.CrossEntropyCriterion()
    rng = np.random.default_rng(0)
    x = mt.Tensor(cp.asarray(rng.standard_normal((batch,) + models.input_shape(net), dtype=np.float32)))
    y = cp.asarray(rng.integers(0, 1000, batch))
    pool = cp.get_default_memory_pool()

    def step():
        mt.train_step(model, crit, opt, x, y)  # the returned loss and logits are dropped at once

    def measured(stop_at=None, on_stop=None):
        gc.collect()
        cp.cuda.Device().synchronize()
        pool.free_all_blocks()
        gc.disable()    # no cycle collection mid-step: both passes free at the same allocations
        try:
            with Ledger(pool.used_bytes(), stop_at, on_stop) as ledger:
                step()
        finally:
            gc.enable()
        cp.cuda.Device().synchronize()
        return ledger

    step()
    step()
    first = measured()
    reserved = pool.total_bytes()          # from an emptied pool: its high-water mark, rounding included
    result = {}

    def at_peak(led):   # inside CuPy's malloc: an exception here would break the step, so it is printed
        try:
            result.update(live=led.live, categories=breakdown(led, model, opt, (x.data, y)))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    second = measured(first.peak_count, at_peak)
    if result.get("live") != first.peak:
        print(f"WARNING: pass 2 had {result.get('live')} bytes live at allocation {first.peak_count}, "
              f"pass 1's peak was {first.peak}: the two steps allocated differently")
    del second
    start, end, times = cp.cuda.Event(), cp.cuda.Event(), []
    for _ in range(5):                   # the step's time, to see that memory was not bought with it
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return {"peak": first.peak, "reserved": reserved, "before_step": first.before,
            "peak_at": f"allocation {first.peak_count}, {first.peak_phase}, {first.peak_site}",
            "step_ms": float(np.median(times)), "categories": result.get("categories", {})}


def torch_step(net, batch):
    """PyTorch strict's step on torchvision's model: max_memory_allocated, max_memory_reserved."""
    import torch

    from benchmarks.harness import set_tf32, setup_cudnn, torch_model
    setup_cudnn(torch)
    set_tf32("strict")
    torch.manual_seed(0)
    tm = torch_model(net, 1000).cuda()
    topt = torch.optim.SGD(tm.parameters(), lr=0.01, momentum=0.9)
    xt = torch.randn((batch,) + models.input_shape(net), device="cuda")
    yt = torch.randint(0, 1000, (batch,), device="cuda")

    def step():
        loss = torch.nn.functional.cross_entropy(tm(xt), yt)
        topt.zero_grad()
        loss.backward()
        topt.step()
    step()
    step()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return {"peak": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}


def table(path):
    """The JSON lines of `path` as one short table: each tree's peak and reserved GiB, step time,
    and PyTorch strict's, per network and batch."""
    rows = [json.loads(line) for line in open(path)]
    print("| network | batch | tree | peak GiB (allocated) | reserved GiB | step ms | PyTorch strict peak | "
          "reserved | ours / PyTorch peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = next((o["torch_strict"] for o in rows if "torch_strict" in o and o["net"] == r["net"]
                  and o["batch"] == r["batch"]), None)
        theirs = (f"{t['peak'] / GIB:.3f} | {t['reserved'] / GIB:.3f} | {r['peak'] / t['peak']:.2f}x"
                  if t else "| |")
        print(f"| {r['net']} | {r['batch']} | {r['tree']} | {r['peak'] / GIB:.3f} | {r['reserved'] / GIB:.3f} | "
              f"{r['step_ms']:.2f} | {theirs} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", help="only print the table of this JSON-lines file (--json's) and exit")
    ap.add_argument("--net", default="alexnet")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--backend", default="gemm", help="every conv layer's backend (default gemm)")
    ap.add_argument("--label", default="this tree", help="what to call the tree in the output")
    ap.add_argument("--torch", action="store_true", help="PyTorch strict's step too")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    ap.add_argument("--weight-spectra", action="store_true",
                    help="fprop keeps each weight spectrum for bprop (reuse_weight_spectra on; off by default)")
    args = ap.parse_args()
    if args.table:
        return table(args.table)
    if args.weight_spectra:
        backends.config.set("reuse_weight_spectra", True)
        args.label += " (weight spectra kept)"
    ours = our_step(args.net, args.batch, args.backend)
    print(f"== {args.net} b{args.batch}, backend {args.backend}, {args.label}: peak {ours['peak'] / GIB:.3f} GiB "
          f"allocated, {ours['reserved'] / GIB:.3f} GiB reserved; {ours['before_step'] / GIB:.3f} GiB live "
          f"before the step; peak at {ours['peak_at']}; step {ours['step_ms']:.2f} ms (median of 5)")
    for category, size in sorted(ours["categories"].items(), key=lambda kv: -kv[1]):
        if size >= 2**20:
            print(f"  {size / GIB:8.3f} GiB {100 * size / ours['peak']:5.1f} %  {category}")
    from benchmarks.harness import provenance
    row = {"net": args.net, "batch": args.batch, "backend": args.backend, "tree": args.label,
           "gemm_workspace_mb": backends.config.get("gemm_workspace_mb"),
           **provenance(cp.cuda.runtime.getDeviceProperties(0)["name"].decode()), **ours}
    if args.torch:
        row["torch_strict"] = torch_step(args.net, args.batch)
        print(f"   PyTorch strict: {row['torch_strict']['peak'] / GIB:.3f} GiB allocated, "
              f"{row['torch_strict']['reserved'] / GIB:.3f} GiB reserved")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

"""Experiment (not a benchmark of record): where the PyTorch adapter's host time and memory go.

bench_pytorch's smoke run put converted AlexNet's eager step at 12.1 ms against PyTorch strict's
3.7 (batch 8, H100) with the CUDA-graph rows on par: host time, ~0.5 ms per conv call. This
times, for each conv of torchvision AlexNet and each pass, one call's host time (perf_counter,
the queue drained before, nothing synchronised inside) at six depths:

  unprepared backends.run_pass with its prepared path off (every call chooses and checks anew)
  framework  backends.run_pass on CuPy arrays, CuPy's own pool and stream (a framework layer)
  scoped     the same inside the adapter's stream scope (PyTorch's stream and caching allocator)
  adapter    minitorch_fft.pytorch._run on torch tensors (the crossings both ways)
  eager      what an eager call runs: conv2d's EagerConv2d for fprop (no grad); bprop and accGrad
             are _run itself, called from EagerConv2d.backward, so the adapter column again
  operator   torch.ops.minitorch_fft.conv2d / _bprop / _accgrad (dispatcher, custom_op's wrapper:
             what a compiled or traced call runs)

with the CuPy allocations one call makes, and the unit costs of the pieces: an allocation and
free through CuPy's pool, through the adapter's allocator (the caching allocator's raw call, the
stream bound), through torch.cuda.caching_allocator_alloc (the stream bound: the adapter before
s11-pt-host) and with the stream looked up per allocation (session 9's); each crossing, the
adapter's and DLPack's; the stream look-up; entering the scope. Then the whole training step
(forward, cross-entropy, backward, SGD), converted (eager path; and forced through torch.ops, as
the adapter ran before s11-pt-host) and stock: host time per step (perf_counter around the step,
queue drained before), a cProfile of the converted step (top functions by own time, to
--profile-out), and memory: peak allocated per step with and without spectra reuse against stock,
the spectra held at the end of the forward, and what the backends keep across steps (cufft's
scratch buffers and plans).

  python -m benchmarks.experiments.exp_pytorch_host --batch 8
  python -m benchmarks.experiments.exp_pytorch_host --cpu      # eager path against torch.ops, no GPU
  python -m benchmarks.experiments.exp_pytorch_host --batch 128 --profile-out /tmp/prof.txt
  cd <older tree> && PYTHONPATH=. python <this file> --batch 128 --step-only   # before/after
"""
import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

from benchmarks.harness import PASSES, StackSampler, host_probe_ms, median_ms


def host_us(fn, sync, repeat=30):
    """Median microseconds the host spends issuing fn(), the device drained before each call."""
    return median_ms(fn, "cpu", 3, repeat, before=sync) * 1e3


@contextlib.contextmanager
def scope(pt, device):
    """The adapter's stream scope around a block, as _run enters it."""
    cp, on, capture = pt._cuda_scope(device.index)
    with on.device, on.stream, cp.cuda.using_allocator(on.malloc), capture:
        yield cp


def unit_costs(torch, cp, pt, sync):
    """{piece: microseconds} for one allocation (+ free), one crossing, one scope entry."""
    device = torch.device("cuda", torch.cuda.current_device())
    size = 1 << 20

    def alloc_free(malloc):
        def run():
            for _ in range(100):
                malloc(size)      # freed at once: nothing holds the pointer
        return run

    def free(ptr, device_id):
        torch.cuda.caching_allocator_delete(ptr)

    def stream_per_alloc(size, device_id):   # session 9's: the current stream looked up per allocation
        return torch.cuda.caching_allocator_alloc(size, device_id, torch.cuda.current_stream(device_id))

    ptr = torch.cuda.current_stream(device).cuda_stream

    def stream_bound(size, device_id):       # before s11-pt-host: the public wrapper, a device guard each
        return torch.cuda.caching_allocator_alloc(size, device_id, ptr)

    session9 = cp.cuda.memory.PythonFunctionAllocator(stream_per_alloc, free).malloc
    wrapper = cp.cuda.memory.PythonFunctionAllocator(stream_bound, free).malloc
    with scope(pt, device):
        adapter = cp.cuda.get_allocator()
    t = torch.empty(size // 4, device=device)
    a = cp.empty(size // 4, dtype=cp.float32)
    costs = {
        "alloc+free, CuPy's pool": host_us(alloc_free(cp.get_default_memory_pool().malloc), sync) / 100,
        "alloc+free, adapter (raw call, stream bound)": host_us(alloc_free(adapter), sync) / 100,
        "alloc+free, caching_allocator_alloc (bound)": host_us(alloc_free(wrapper), sync) / 100,
        "alloc+free, session 9 (stream per alloc)": host_us(alloc_free(session9), sync) / 100,
        "torch.cuda.current_stream()": host_us(lambda: torch.cuda.current_stream(device), sync),
        "torch._C._cuda_getCurrentRawStream": host_us(lambda: torch._C._cuda_getCurrentRawStream(device.index),
                                                      sync),
    }
    with scope(pt, device):   # as a pass crosses: CuPy on PyTorch's stream
        costs["adapter in: _cupy_view(tensor)"] = host_us(lambda: pt._cupy_view(t, cp), sync)
        costs["adapter out: _from_cupy(array)"] = host_us(lambda: pt._from_cupy(a), sync)
        costs["cp.from_dlpack(tensor)"] = host_us(lambda: cp.from_dlpack(t), sync)
        costs["torch.from_dlpack(cupy array)"] = host_us(lambda: torch.from_dlpack(a), sync)
        try:
            costs["cp.from_dlpack, producer told stream -1"] = host_us(lambda: cp.from_dlpack(_SameStream(t)), sync)
        except Exception as e:  # noqa: BLE001 - an alternative this CuPy or PyTorch refuses
            print(f"  cp.from_dlpack, producer told stream -1: refused ({type(e).__name__}: {e})")

    def enter_scope():
        with scope(pt, device):
            pass
    costs["_cuda_scope look-up"] = host_us(lambda: pt._cuda_scope(device.index), sync)
    costs["enter+exit the adapter's scope"] = host_us(enter_scope, sync)
    return costs


class _SameStream:
    """A tensor as a DLPack producer told the consumer's stream is its own (-1: no stream lookups)."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None, **kwargs):
        return self.t.__dlpack__(stream=-1, **kwargs)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


class CountingAllocator:
    """CuPy allocations counted, passed on to `malloc`."""

    def __init__(self, malloc):
        self.inner, self.count = malloc, 0

    def malloc(self, size):
        self.count += 1
        return self.inner(size)


def per_pass(torch, cp, pt, backends, layers, sync):
    """[(layer, pass, {depth: us}, allocations per call)] for every conv and pass."""
    import torch.nn.functional as TF
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for name, x_shape, w_shape, stride, padding in layers:
        x = torch.randn(x_shape, device=device)
        w = torch.randn(w_shape, device=device)
        gy = torch.randn(TF.conv2d(x, w, stride=stride, padding=padding).shape, device=device)
        xa, wa, gya = cp.from_dlpack(x), cp.from_dlpack(w), cp.from_dlpack(gy)
        geom = dict(x_shape=tuple(x_shape), w_shape=tuple(w_shape), stride=tuple(stride), padding=tuple(padding))
        st, pd = list(stride), list(padding)
        calls = {
            "fprop": ((xa, wa), (x, w), lambda: torch.ops.minitorch_fft.conv2d(x, w, st, pd, "auto")),
            "bprop": ((gya, wa, x_shape), (gy, w),
                      lambda: torch.ops.minitorch_fft.conv2d_bprop(gy, w, list(x_shape), st, pd, "auto")),
            "accgrad": ((gya, xa, w_shape), (gy, x),
                        lambda: torch.ops.minitorch_fft.conv2d_accgrad(gy, x, list(w_shape), st, pd, "auto")),
        }
        for p in PASSES:
            arrays, tensors, op = calls[p]

            def framework():
                backends.run_pass("auto", p, *arrays, **geom)

            def scoped():
                with scope(pt, device):
                    backends.run_pass("auto", p, *arrays, **geom)

            def adapter():
                pt._run(p, "auto", *tensors, x_shape, w_shape, stride, padding)

            def eager():
                with torch.no_grad():
                    pt.conv2d(x, w, stride, padding, "auto")

            op()                  # tunes (auto) and compiles outside the timing
            sync()
            with unprepared_passes(backends):   # entered once: its patching is not timed (it was to 00338fd)
                unprepared = host_us(framework, sync)
            us = {"unprepared": unprepared, "framework": host_us(framework, sync), "scoped": host_us(scoped, sync),
                  "adapter": host_us(adapter, sync), "operator": host_us(op, sync)}
            us["eager"] = host_us(eager, sync) if p == "fprop" else us["adapter"]
            with scope(pt, device):
                counter = CountingAllocator(cp.cuda.get_allocator())
                with cp.cuda.using_allocator(counter.malloc):
                    backends.run_pass("auto", p, *arrays, **geom)
            rows.append((name, p, us, counter.count))
    return rows


@contextlib.contextmanager
def unprepared_passes(backends):
    """run_pass with its prepared path off inside the block: no entry found, none made (the path
    every call took before 40bbc4c for the backends without prepare(): fbfft, polyphase, cufft)."""
    import unittest.mock
    with unittest.mock.patch.object(backends, "_prepared", {}), \
            unittest.mock.patch.object(backends, "_prepare", lambda *args: None):
        yield


def prepared_ab(step, backends, sync, pairs):
    """{on, off, diff}: host ms of one step with run_pass's prepared path and without it, the two
    taken in turn `pairs` times (each after 2 untimed steps in its mode), so that a host's slow
    spell falls on both: the medians, and the median of each pair's difference (off - on)."""
    on, off = [], []
    for _ in range(pairs):
        on.append(median_ms(step, "cpu", 2, 1, before=sync))
        with unprepared_passes(backends):
            off.append(median_ms(step, "cpu", 2, 1, before=sync))
    return {"on": statistics.median(on), "off": statistics.median(off),
            "diff": statistics.median(b - a for a, b in zip(on, off))}


def conv_geometries(torch, model, batch):
    """[(name, x_shape, w_shape, stride, padding)] of model's Conv2d layers, in forward order."""
    found, hooks = [], []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d):
            hooks.append(m.register_forward_hook(
                lambda m, inp, out, name=name: found.append(
                    (name, (batch,) + tuple(inp[0].shape[1:]), tuple(m.weight.shape), tuple(m.stride),
                     tuple(m.padding)))))
    with torch.no_grad():
        model(torch.zeros(1, 3, 224, 224))
    for h in hooks:
        h.remove()
    return found


def held_bytes(objs):
    """Device bytes of arrays and cuFFT plans' work areas among objs."""
    total = 0
    for o in objs:
        if isinstance(o, (tuple, list)):
            total += held_bytes(o)
        elif hasattr(o, "nbytes"):
            total += o.nbytes
        elif getattr(o, "work_area", None) is not None:
            total += o.work_area.mem.size
    return total


def step_study(torch, pt, backends, model_fn, batch, sync, steps, profile_out, sample_out=None):
    """Host ms per step and peak MiB: stock, converted with and without spectra reuse; cProfile."""
    import copy
    import unittest.mock
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, generator=g).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    base = model_fn()
    out, spectra = {}, {}
    rows = [("stock", False, False), ("converted, spectra reused", True, True), ("converted, no reuse", True, False)]
    if hasattr(backends, "_prepare"):   # this tree has run_pass's prepared path: the step without it as well
        rows.append(("converted, unprepared", True, True))
    if hasattr(pt, "_eager"):   # this tree has the eager path: the step through torch.ops as well
        rows.append(("converted, via torch.ops", True, True))
    for label, converted, reuse in rows:
        model = copy.deepcopy(base).to(device)
        if converted:
            pt.convert(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        scope = pt.reuse_spectra if reuse else contextlib.nullcontext

        def step():
            opt.zero_grad(set_to_none=False)
            with scope() as cache:
                logits = model(x)
                if cache is not None:
                    spectra[label] = held_bytes(s for _, s in cache._entries.values())
                torch.nn.functional.cross_entropy(logits, y).backward()
            opt.step()
        via_ops = contextlib.ExitStack()
        if label.endswith("via torch.ops"):   # every call as a traced one would make it
            via_ops.enter_context(unittest.mock.patch.object(pt, "_eager", lambda *tensors: False))
        if label.endswith("unprepared"):
            via_ops.enter_context(unprepared_passes(backends))
        for _ in range(3):
            step()
        sync()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        sync()
        peak = torch.cuda.max_memory_allocated()
        host_ms = host_us(step, sync, repeat=steps) / 1e3
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        out[label] = {"host_ms": host_ms, "wall_ms": (time.perf_counter() - t0) / steps * 1e3,
                      "peak_mib": peak / 2**20, "resident_mib": before / 2**20,
                      "kept_mib": held_bytes(backends.held_on_device()) / 2**20}
        if label == "converted, spectra reused" and hasattr(backends, "_prepare"):
            out["prepared path A/B"] = prepared_ab(step, backends, sync, steps)
        if label == "converted, spectra reused" and profile_out:   # the eager path, as bench_pytorch runs it
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(steps):
                step()
            sync()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
            with open(profile_out, "w") as f:
                f.write(f"cProfile of {steps} converted steps, batch {batch}, by own time\n{text.getvalue()}")
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
            with open(profile_out, "a") as f:
                f.write(f"\nby cumulative time\n{text.getvalue()}")
        if label == "converted, spectra reused" and sample_out:   # the same steps, sampled (no per-call hooks)
            with StackSampler(2e-4, all_threads=True) as sampler:   # the backward runs on the engine's thread
                for _ in range(3 * steps):
                    step()
                sync()
            root = str(Path(__file__).resolve().parents[2]) + "/"
            with open(sample_out, "w") as f:
                f.write(f"Sampled stacks of {3 * steps} converted eager steps, batch {batch}\n"
                        + sampler.report(60, strip=(root, str(Path(torch.__file__).parents[1]) + "/")) + "\n")
        via_ops.close()
        del model, opt
        backends.cufft.release_buffers()
        sync()
        torch.cuda.empty_cache()
    return out, spectra


def cpu_calls(torch, pt, repeat):
    """{path: host us} for one small layer's fprop+bprop+accGrad on the CPU (NumPy, gemm), through
    _run alone (the three passes), the eager path (conv2d: EagerConv2d) and torch.ops (conv2d with
    the eager path turned off, as a traced call runs): what the dispatcher costs without a GPU."""
    import unittest.mock
    x = torch.randn(1, 2, 6, 6, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, requires_grad=True)
    gy = torch.randn(1, 3, 6, 6)
    geometry = (x.shape, w.shape, [1, 1], [1, 1])

    def passes():
        pt._run("fprop", "gemm", x, w, *geometry)
        pt._run("bprop", "gemm", gy, w, *geometry)
        pt._run("accgrad", "gemm", gy, x, *geometry)

    def step():
        pt.conv2d(x, w, 1, 1, "gemm").backward(gy)
    us = {"_run, three passes": host_us(passes, None, repeat),
          "eager: conv2d + backward": host_us(step, None, repeat)}
    with unittest.mock.patch.object(pt, "_eager", lambda *tensors: False):
        us["torch.ops: conv2d + backward"] = host_us(step, None, repeat)
    return us


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="training steps timed and profiled")
    ap.add_argument("--step-only", action="store_true",
                    help="the whole step only (public API alone: runs against an older tree's adapter too)")
    ap.add_argument("--profile-out", default=None, help="file for the converted step's cProfile")
    ap.add_argument("--sample-out", default=None, help="file for a sampling profile of the converted step")
    ap.add_argument("--cpu", action="store_true",
                    help="only the eager path against torch.ops on the CPU, one small layer (no GPU needed)")
    args = ap.parse_args()
    if args.cpu:
        import torch

        from minitorch_fft import pytorch as pt
        print(f"CPU, torch {torch.__version__}: host us per layer (fprop, bprop, accGrad), median of 200")
        for path, us in cpu_calls(torch, pt, 200).items():
            print(f"  {path:32s} {us:7.1f}")
        return

    import cupy as cp
    import torch
    import torchvision

    try:
        from minitorch_fft import backends
    except ImportError:   # a tree from before session 52 (gpu_pytorch.sh's BASE): a top-level package
        import backends
    from minitorch_fft import pytorch as pt
    torch.backends.cudnn.allow_tf32 = False    # strict fp32, as bench_pytorch's fp32 rows
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    sync = torch.cuda.synchronize
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, cupy {cp.__version__}, "
          f"batch {args.batch}, host probe {host_probe_ms():.2f} ms (harness.host_probe_ms)")
    if not args.step_only:
        print("\nunit costs, us per call (host):")
        for piece, us in unit_costs(torch, cp, pt, sync).items():
            print(f"  {piece:42s} {us:7.1f}")
        layers = conv_geometries(torch, torchvision.models.alexnet(), args.batch)
        rows = per_pass(torch, cp, pt, backends, layers, sync)
        depths = ("unprepared", "framework", "scoped", "adapter", "eager", "operator")
        print(f"\nhost us per call, AlexNet (torchvision) batch {args.batch}, auto:")
        print(f"  {'layer':12s} {'pass':8s} " + " ".join(f"{d:>9s}" for d in depths) + "  allocations")
        for name, p, us, n in rows:
            print(f"  {name:12s} {p:8s} " + " ".join(f"{us[d]:9.1f}" for d in depths) + f"  {n:5d}")
        sums = {d: sum(us[d] for _, _, us, _ in rows) for d in depths}
        print(f"  {'sum (ms)':21s} " + " ".join(f"{sums[d] / 1e3:9.3f}" for d in depths))
        fprops = [r for r in rows if r[1] == "fprop"]
        print("  median saved per call by run_pass's prepared path: "
              f"{statistics.median(r[2]['unprepared'] - r[2]['framework'] for r in rows):.1f} us")
        print("  median extra per call, each depth over the one before: scope "
              f"{statistics.median(r[2]['scoped'] - r[2]['framework'] for r in rows):.1f} us, crossings "
              f"{statistics.median(r[2]['adapter'] - r[2]['scoped'] for r in rows):.1f} us, operator "
              f"{statistics.median(r[2]['operator'] - r[2]['adapter'] for r in rows):.1f} us; eager fprop "
              f"{statistics.median(r[2]['eager'] - r[2]['adapter'] for r in fprops):.1f} us against the "
              f"operator's {statistics.median(r[2]['operator'] - r[2]['adapter'] for r in fprops):.1f}")
    steps, spectra = step_study(torch, pt, backends, lambda: torchvision.models.alexnet(num_classes=1000),
                                args.batch, sync, args.steps, args.profile_out, args.sample_out)
    print(f"\ntraining step, AlexNet batch {args.batch} (host: issuing one step; wall: {args.steps} steps "
          "back to back, per step):")
    ab = steps.pop("prepared path A/B", None)
    for label, r in steps.items():
        print(f"  {label:28s} host {r['host_ms']:7.2f} ms  wall {r['wall_ms']:7.2f} ms  peak "
              f"{r['peak_mib']:7.0f} MiB  (resident before the step {r['resident_mib']:.0f} MiB)")
    if ab is not None:
        print(f"  run_pass's prepared path, converted with spectra reused, {args.steps} steps on and off in turn: host "
              f"{ab['on']:.2f} ms on, {ab['off']:.2f} off (medians); each pair's difference, median "
              f"{ab['diff']:.3f} ms")
    for label, nbytes in spectra.items():
        print(f"  spectra held at the end of the forward ({label}): {nbytes / 2**20:.0f} MiB")
    for label, r in steps.items():
        print(f"  kept by the backends across steps ({label}; cufft scratch + plans): {r['kept_mib']:.0f} MiB")
    workspace = ("none of its own (captures borrow PyTorch's handle)" if pt._torch_shares_libcublas() else
                 f"{backends.cgemm.GRAPH_WORKSPACE_BYTES / 2**20:.0f} MiB")
    print(f"  the adapter's cuBLAS capture workspace: {workspace}")


if __name__ == "__main__":
    main()

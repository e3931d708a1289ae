"""Experiment (not a benchmark of record): where the PyTorch adapter's host time and memory go.

bench_pytorch's smoke run put converted AlexNet's eager step at 12.1 ms against PyTorch strict's
3.7 (batch 8, H100) with the CUDA-graph rows on par: host time, ~0.5 ms per conv call. This
times, for each conv of torchvision AlexNet and each pass, one call's host time (perf_counter,
the queue drained before, nothing synchronised inside) at four depths:

  framework  backends.run_pass on CuPy arrays, CuPy's own pool and stream (a framework layer)
  scoped     the same inside the adapter's stream scope (PyTorch's stream and caching allocator)
  adapter    minitorch_fft.pytorch._run on torch tensors (DLPack both ways)
  operator   torch.ops.minitorch_fft.conv2d / _bprop / _accgrad (dispatcher, custom_op's wrapper)

with the CuPy allocations one call makes, and the unit cost of the pieces: an allocation and
free through CuPy's pool, through the adapter's allocator, and through session 9's (which asked
torch.cuda.current_stream() on every allocation); one DLPack crossing each way; entering the
scope. Then the whole training step (forward, cross-entropy, backward, SGD), converted and stock:
host time per step (perf_counter around the step, queue drained before), a cProfile of the
converted step (top functions by own time, to --profile-out), and memory: peak allocated per step
with and without spectra reuse against stock, the spectra held at the end of the forward, and
what the backends keep across steps (cufft's scratch buffers and plans).

  python -m benchmarks.experiments.exp_pytorch_host --batch 8
  python -m benchmarks.experiments.exp_pytorch_host --batch 128 --profile-out /tmp/prof.txt
  cd <older tree> && PYTHONPATH=. python <this file> --batch 128 --step-only   # before/after
"""
import argparse
import cProfile
import io
import pstats
import statistics
import time

from benchmarks.harness import PASSES, median_ms


def host_us(fn, sync, repeat=30):
    """Median microseconds the host spends issuing fn(), the device drained before each call."""
    return median_ms(fn, "cpu", 3, repeat, before=sync) * 1e3


def unit_costs(torch, cp, pt, sync):
    """{piece: microseconds} for one allocation (+ free), one DLPack crossing, one scope entry."""
    device = torch.device("cuda", torch.cuda.current_device())
    size = 1 << 20

    def alloc_free(malloc):
        def run():
            for _ in range(100):
                malloc(size)      # freed at once: nothing holds the pointer
        return run

    def old_malloc(size, device_id):   # session 9's: the current stream looked up per allocation
        return torch.cuda.caching_allocator_alloc(size, device_id, torch.cuda.current_stream(device_id))

    old = cp.cuda.memory.PythonFunctionAllocator(old_malloc, pt._torch_free).malloc
    with pt._on_current_stream(device):
        new = cp.cuda.get_allocator()
    t = torch.empty(size // 4, device=device)
    a = cp.empty(size // 4, dtype=cp.float32)
    costs = {
        "alloc+free, CuPy's pool": host_us(alloc_free(cp.get_default_memory_pool().malloc), sync) / 100,
        "alloc+free, adapter (stream bound)": host_us(alloc_free(new), sync) / 100,
        "alloc+free, session 9 (stream per alloc)": host_us(alloc_free(old), sync) / 100,
        "torch.cuda.current_stream()": host_us(lambda: torch.cuda.current_stream(device), sync),
    }
    with pt._on_current_stream(device):   # as a pass crosses: CuPy on PyTorch's stream
        costs["cp.from_dlpack(tensor)"] = host_us(lambda: cp.from_dlpack(t), sync)
        costs["torch.from_dlpack(cupy array)"] = host_us(lambda: torch.from_dlpack(a), sync)
        # what cheaper crossings would cost (not used: measured to see whether they are worth it)
        alternatives = {
            "  alt: cp.from_dlpack, producer told stream -1": lambda: cp.from_dlpack(_SameStream(t)),
            "  alt: cp.ndarray on the tensor's pointer": lambda: cp.ndarray(
                t.shape, cp.float32, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(
                    t.data_ptr(), t.nbytes, t, device.index), 0)),
            "  alt: torch.from_dlpack(capsule, stream -1)": lambda: torch.from_dlpack(a.__dlpack__(stream=-1)),
        }
        for piece, fn in alternatives.items():
            try:
                costs[piece] = host_us(fn, sync)
            except Exception as e:  # noqa: BLE001 - an alternative this CuPy or PyTorch refuses
                print(f"  {piece.strip()}: refused ({type(e).__name__}: {e})")

    def enter_scope():
        with pt._on_current_stream(device):
            pass
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
                with pt._on_current_stream(device):
                    backends.run_pass("auto", p, *arrays, **geom)

            def adapter():
                pt._run(p, "auto", *tensors, x_shape, w_shape, stride, padding)

            op()                  # tunes (auto) and compiles outside the timing
            sync()
            us = {"framework": host_us(framework, sync), "scoped": host_us(scoped, sync),
                  "adapter": host_us(adapter, sync), "operator": host_us(op, sync)}
            with pt._on_current_stream(device):
                counter = CountingAllocator(cp.cuda.get_allocator())
                with cp.cuda.using_allocator(counter.malloc):
                    backends.run_pass("auto", p, *arrays, **geom)
            rows.append((name, p, us, counter.count))
    return rows


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


def step_study(torch, pt, backends, model_fn, batch, sync, steps, profile_out):
    """Host ms per step and peak MiB: stock, converted with and without spectra reuse; cProfile."""
    import contextlib
    import copy
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, generator=g).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    base = model_fn()
    out, spectra = {}, {}
    for label, converted, reuse in (("stock", False, False), ("converted, spectra reused", True, True),
                                    ("converted, no reuse", True, False)):
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
        if converted and reuse and profile_out:
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
        del model, opt
        backends.cufft.release_buffers()
        sync()
        torch.cuda.empty_cache()
    return out, spectra


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="training steps timed and profiled")
    ap.add_argument("--step-only", action="store_true",
                    help="the whole step only (public API alone: runs against an older tree's adapter too)")
    ap.add_argument("--profile-out", default=None, help="file for the converted step's cProfile")
    args = ap.parse_args()

    import cupy as cp
    import torch
    import torchvision

    import backends
    from minitorch_fft import pytorch as pt
    torch.backends.cudnn.allow_tf32 = False    # strict fp32, as bench_pytorch's fp32 rows
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    sync = torch.cuda.synchronize
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, cupy {cp.__version__}, "
          f"batch {args.batch}")
    if not args.step_only:
        print("\nunit costs, us per call (host):")
        for piece, us in unit_costs(torch, cp, pt, sync).items():
            print(f"  {piece:42s} {us:7.1f}")
        layers = conv_geometries(torch, torchvision.models.alexnet(), args.batch)
        rows = per_pass(torch, cp, pt, backends, layers, sync)
        depths = ("framework", "scoped", "adapter", "operator")
        print(f"\nhost us per call, AlexNet (torchvision) batch {args.batch}, auto:")
        print(f"  {'layer':12s} {'pass':8s} " + " ".join(f"{d:>9s}" for d in depths) + "  allocations")
        for name, p, us, n in rows:
            print(f"  {name:12s} {p:8s} " + " ".join(f"{us[d]:9.1f}" for d in depths) + f"  {n:5d}")
        sums = {d: sum(us[d] for _, _, us, _ in rows) for d in depths}
        print(f"  {'sum (ms)':21s} " + " ".join(f"{sums[d] / 1e3:9.3f}" for d in depths))
        print("  median extra per call over the framework: scope "
              f"{statistics.median(r[2]['scoped'] - r[2]['framework'] for r in rows):.1f} us, DLPack "
              f"{statistics.median(r[2]['adapter'] - r[2]['scoped'] for r in rows):.1f} us, operator "
              f"{statistics.median(r[2]['operator'] - r[2]['adapter'] for r in rows):.1f} us")
    steps, spectra = step_study(torch, pt, backends, lambda: torchvision.models.alexnet(num_classes=1000),
                                args.batch, sync, args.steps, args.profile_out)
    print(f"\ntraining step, AlexNet batch {args.batch} (host: issuing one step; wall: {args.steps} steps "
          "back to back, per step):")
    for label, r in steps.items():
        print(f"  {label:28s} host {r['host_ms']:7.2f} ms  wall {r['wall_ms']:7.2f} ms  peak "
              f"{r['peak_mib']:7.0f} MiB  (resident before the step {r['resident_mib']:.0f} MiB)")
    for label, nbytes in spectra.items():
        print(f"  spectra held at the end of the forward ({label}): {nbytes / 2**20:.0f} MiB")
    for label, r in steps.items():
        print(f"  kept by the backends across steps ({label}; cufft scratch + plans): {r['kept_mib']:.0f} MiB")
    print(f"  the adapter's cuBLAS capture workspace: {backends.cgemm.GRAPH_WORKSPACE_BYTES / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()

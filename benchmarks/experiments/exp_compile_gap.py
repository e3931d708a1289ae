"""Experiment (not a benchmark of record): why torch.compile slows the converted model down.

Session 29 (H100, f94d36c, bench_pytorch --nets alexnet --impls strict,fp32 --compile): converted
AlexNet b128 took 9.25 ms a step eagerly and 10.84 compiled, where PyTorch strict took 12.63 and
13.04; compiled, the converted step's peak was 1630 MiB against the stock model's 1570 (eagerly
under it). This runs four rows in one process, as bench_pytorch builds them (stock strict and
converted fp32, each eager and compiled with inductor, compiled rows last) and reports per row:

- the step's median time (CUDA events) and its issue time (the host clock around a step started
  on an idle GPU, nothing synchronised inside: where it is near the step's time, the step is
  host-bound);
- the GPU's kernel time a step (torch.profiler, its kernels' device time summed), the kernels
  with the most time and the host operators with the most own time;
- the step's peak (torch.cuda.max_memory_allocated, less what was allocated before the step) and
  what is alive at that peak: one step recorded with torch.cuda.memory._record_memory_history,
  its allocations replayed to the peak, grouped by the innermost frame outside torch and CuPy
  (inductor's generated code names its line; ours names the backend).

With --python N, each row also lists the Python functions with the most own time (cProfile over N
steps), to find where a compiled row's host time goes.

With --gaps N, each row also lists where the GPU waits for the host: idle gaps between its busy
intervals over N steps (each from an idle GPU), by the host operator running when each gap ended.

With --split N, each converted row also splits its issue time (N steps, each from an idle GPU) into
the host time inside our passes (minitorch_fft.pytorch._crossing: the crossings, the CuPy scope and
backends.run_pass, itself also given) and the rest (PyTorch: autograd, the dispatcher, a compiled
region's wrappers, and the stock layers), by timing those two functions; it also gives run_pass's
time by pass, the time of the pieces under the passes, and our crossings' time by their passes (a
layer's fprop, or its backward's passes) (issue_split). The split runs before the row's profiler
session; set TEARDOWN_CUPTI=1 so that an earlier row's session leaves no residue.

With --passes, each converted row also finds which pass its peak is in: one step with every
backends.run_pass call timed by the allocator's own counters (torch.cuda.memory_allocated and its
peak, reset at each call's start and end: host-side, no synchronisation), and lists the passes and
the stretches between them (PyTorch's own work) with the highest peaks, each with what was
allocated at its start and its transient (the peak less that), in MiB above the step's start.
With --channels-last it times the adapter's crossings instead (a layer's fprop, or its backward
passes together, each labelled with the route auto took), since a pass on cuDNN's NHWC plans does
not go through run_pass.

The row "stock compiled NCHW" is "stock compiled" with inductor's layout optimization off
(torch._inductor.config.layout_optimization): inductor otherwise runs a convolution-heavy model's
convolutions channels-last, where cuDNN's TF32 kernels need no layout conversions (with
--channels-last the row's model and input are channels-last all the same). Where the row is asked
for, Dynamo is reset before every compiled row.

With --output-code, inductor's generated code for the converted model goes to stderr
(TORCH_LOGS=output_code for that compile only).

With --convert-channels-last the converted rows' model is convert(model, channels_last=True)'s (an NCHW model
run channels-last inside; --passes then times the crossings, as with --channels-last), the stock rows' NCHW.

With --tf32, the stock rows run PyTorch's TF32 defaults and the converted ones the framework's
TF32 mode (bench_pytorch's "default" and "tf32" rows).

With --compile-mode reduce-overhead, the compiled rows run under inductor's CUDA graphs (cudagraph
trees), stepped as bench_pytorch steps them (cudagraph_mark_step_begin each step, the gradients set
to None). A replay allocates nothing, so such a row's peak and what is alive at it come from the
trees' recording step (the second call), traced as it runs; every row then starts from a clean
state (bench_pytorch._free: Dynamo and the trees reset, so no earlier row's compiled model is freed
inside it). Such a row's peak is above the recording step's start, after the trees have freed the
warm-up's outputs (the gradients among them), where an eager row's is above a step's start with
its gradients held: compare stock with converted in the same mode. --left does not go with it (its
three recorded steps would hold the recording); --passes and --split have nothing to time in a
replay and say so.

  python -m benchmarks.experiments.exp_compile_gap --net overfeat_fast --tf32 --compile-mode reduce-overhead \
      --rows "stock compiled,converted compiled"

  python -m benchmarks.experiments.exp_compile_gap --net alexnet --batch 128 2> code.log
"""
import argparse
import contextlib
import copy
import time
from collections import Counter

from benchmarks.bench_pytorch import IMAGE, _free, held, peak_held
from benchmarks.harness import median_ms, set_tf32, setup_cudnn, torch_model

LEFT_ENTRIES = 1_000_000   # --left: the allocator trace's length (a row's first three steps fit)
ROWS = {"stock eager": (False, False), "converted eager": (True, False),   # label: (converted, compiled)
        "stock compiled": (False, True), "converted compiled": (True, True),
        "stock compiled NCHW": (False, True)}   # inductor's layout optimization off (NCHW_ROWS)
NCHW_ROWS = {"stock compiled NCHW"}   # inductor keeps NCHW: no channels-last convolutions (session 42)
LIBRARY_PARTS = ("/torch/", "/cupy/", "/cupy_backends/", "/contextlib.py", "/functools.py", "<frozen")


def _replay(trace):
    """(live bytes, {address: alloc event}) after each allocation and free of a caching-allocator
    trace (the device_traces list of torch.cuda.memory._snapshot()): allocations replayed in order,
    frees at free_requested. The dict is the replay's own, updated in place."""
    alive, total = {}, 0
    for event in trace:
        action = event["action"]
        if action == "alloc":
            alive[event["addr"]] = event
            total += event["size"]
        elif action == "free_requested" and event["addr"] in alive:
            total -= alive.pop(event["addr"])["size"]
        else:
            continue
        yield total, alive


def alive_at_peak(trace, key=None):
    """(peak bytes above the trace's start, {key(frames) (default where): bytes}): the allocations
    alive at the trace's highest point (_replay). Those alive at the trace's end: alive_at_end."""
    peak, at_peak = 0, {}
    for total, alive in _replay(trace):
        if total > peak:
            peak, at_peak = total, dict(alive)
    return peak, _grouped(at_peak.values(), key)


def alive_at_end(trace, key=None):
    """{key(frames) (default where): bytes} of the trace's allocations not freed by its end (what
    the steps leave behind: plans, tables, handles' buffers), as _replay replays them."""
    alive = {}
    for _, alive in _replay(trace):
        pass
    return _grouped(alive.values(), key)


def where_and_call(frames):
    """where(frames), and for an allocation made under a compiled graph's call of an operator (ours: the
    adapter's allocator), that call's line of inductor's generated code (which layer's pass it is: the
    operator and its buffers, read while the process still has the file)."""
    import linecache
    at = where(frames)
    if not at.startswith("inductor"):
        for f in frames:
            if "torchinductor" in f.get("filename", ""):
                call = linecache.getline(f["filename"], f.get("line", 0)).strip()
                return f"{at} <- {call[:110] or f.get('name')}"
    return at


def where_and_inner(frames):
    """where(frames), and the innermost Python frame of all (a library's) after it."""
    inner = f"{'/'.join(frames[0].get('filename', '').split('/')[-2:])}:{frames[0].get('line')}" if frames else "-"
    return f"{where(frames)} <- {inner}"


def _grouped(events, key=None):
    groups = Counter()
    for event in events:
        groups[(key or where)(event.get("frames", ()))] += event["size"]
    return groups


def where(frames):
    """The innermost frame outside PyTorch, CuPy, the standard library and the adapter's allocator
    (minitorch_fft.pytorch's lambda), as file:line function."""
    for f in frames:
        name = f.get("filename", "")
        adapter_allocator = name.endswith("minitorch_fft/pytorch.py") and f.get("name") == "<lambda>"
        if not adapter_allocator and not any(part in name for part in LIBRARY_PARTS):
            short = "inductor " + name.rsplit("/", 1)[-1][:12] if "torchinductor" in name else name.rsplit("/", 1)[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "(torch or CuPy only)"


def profile_step(step, steps, top):
    """(kernel ms a step, [(kernel, ms a step)], [(host op, own ms a step)]) over `steps` steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels, host = Counter(), Counter()
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            host[e.name[:70]] += e.self_cpu_time_total / 1e3 / steps
        elif gpu_work(e):
            kernels[e.name[:70]] += e.device_time_total / 1e3 / steps
    return sum(kernels.values()), kernels.most_common(top), host.most_common(top)


def gpu_gaps(step, steps, top, min_us=5.0):
    """Where the GPU waits for the host: `steps` steps, each started on an idle GPU and marked with
    record_function("step"), under torch.profiler; idle_gaps() of what it recorded."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            with record_function("step"):
                step()
        torch.cuda.synchronize()
    device, host = [], []
    for e in prof.events():
        span = (e.time_range.start, e.time_range.end, e.name)
        if e.device_type != torch.autograd.DeviceType.CUDA:
            host.append(span)
        elif gpu_work(e):
            device.append(span)
    marks = [(lo, hi) for lo, hi, name in host if name == "step"]
    ops = [op for op in host if op[2] != "step" and not op[2].startswith(("cuda", "cu", "Activity"))]
    return idle_gaps(marks, [(lo, hi) for lo, hi, _ in device], ops, top, min_us)


def gpu_work(event):
    """Whether a device event of torch.profiler is GPU work (a kernel, copy or set), not a user
    annotation: the profiler also lists a host range that a library marks on the GPU (the
    optimizer's Optimizer.step#SGD.step, inductor's graph calls) among the device events, spanning
    the kernels inside it. Until session 35's review these counted as kernels (profile_step: the
    SGD range's ~0.5 ms a step twice) and as busy time (gpu_gaps: the gaps inside the range hidden)."""
    return not getattr(event, "is_user_annotation", False)


def idle_gaps(marks, device, ops, top, min_us=5.0):
    """(idle ms a step, busy ms a step, span ms a step, [(where, idle ms a step, gaps a step)]) from
    times in us: marks the steps' host (start, end), device the GPU's busy (start, end) intervals,
    ops the host operators' (start, end, name). A step's device intervals are those starting
    between its start and the next step's; merged in time order, a gap of more than `min_us` from
    the step's start or the last busy interval to the next one is idle. A gap goes to the innermost
    host operator running (on any thread) at its end, when the host had just launched the work that
    ended it, with the outermost one beside it ("inner < outer")."""
    device = sorted(device)
    marks = sorted(marks)
    idle = busy = span = 0.0
    where, count = Counter(), Counter()
    for i, (start, _) in enumerate(marks):
        stop = marks[i + 1][0] if i + 1 < len(marks) else float("inf")
        reached = start
        for lo, hi in (d for d in device if start <= d[0] < stop):
            if lo - reached > min_us:
                idle += lo - reached
                inside = [op for op in ops if op[0] <= lo <= op[1]]
                label = "(no host operator)"
                if inside:
                    inner = min(inside, key=lambda op: op[1] - op[0])
                    outer = max(inside, key=lambda op: op[1] - op[0])
                    label = inner[2][:48] + ("" if outer is inner else f" < {outer[2][:40]}")
                where[label] += lo - reached
                count[label] += 1
            busy += max(0.0, hi - max(lo, reached))
            reached = max(reached, hi)
        span += reached - start
    n = max(1, len(marks))
    return (idle / 1e3 / n, busy / 1e3 / n, span / 1e3 / n,
            [(w, us / 1e3 / n, count[w] / n) for w, us in where.most_common(top)])


def python_profile(step, steps, top):
    """([(own ms a step, calls a step, 'file:line function')], the same with cumulative ms for the
    project's functions): the Python functions with the most own time, and the project's with the
    most cumulative time, over `steps` steps under cProfile (its overhead inflates every figure;
    compare rows)."""
    import cProfile
    import pstats

    import torch
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats   # (file, line, function): (primitive, calls, own s, cumulative s, callers)
    rows = sorted(((own * 1e3 / steps, calls / steps, f"{'/'.join(file.split('/')[-2:])}:{line} {fn}")
                   for (file, line, fn), (_, calls, own, _, _) in stats.items()), reverse=True)
    ours = sorted(((cumulative * 1e3 / steps, calls / steps, f"{'/'.join(file.split('/')[-2:])}:{line} {fn}")
                   for (file, line, fn), (_, calls, _, cumulative, _) in stats.items()
                   if "/backends/" in file or "/minitorch_fft/" in file), reverse=True)
    return rows[:top], ours[:top]


class Timed:
    """Host seconds spent in module.name (and calls made) while the block runs, the function
    replaced by a timing wrapper: a few hundred nanoseconds a call. Calls nested in another timed
    call are counted in both."""

    def __init__(self, module, name, label=None):
        self.module, self.name, self.seconds, self.calls = module, name, 0.0, 0
        self.label, self.seen, self.spent = label, Counter(), Counter()   # label(*args): what seen and spent
                                                                            # count the calls and seconds by

    def __enter__(self):
        inner = self.original = getattr(self.module, self.name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t0
                self.seconds += spent
                self.calls += 1
                if self.label is not None:
                    label = self.label(*args, **kwargs)
                    self.seen[label] += 1
                    self.spent[label] += spent
        setattr(self.module, self.name, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.original)


def training_step(model, run, x, y, converted, graphs=False):
    """(optimizer, step): SGD with momentum over the model's parameters, and step() one training step
    of `run` (the model, or its compiled form) on x, y, inside reuse_spectra() where the model is
    converted, as bench_pytorch's rows step. graphs: `run` is compiled with mode="reduce-overhead":
    each step begins a new step of the cudagraph trees and sets the gradients to None (the trees'
    outputs, which the next replay overwrites), as bench_pytorch's compiled rows do."""
    import torch

    from minitorch_fft.pytorch import reuse_spectra
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scope = reuse_spectra if converted else contextlib.nullcontext

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=graphs)
        with scope():
            torch.nn.functional.cross_entropy(run(x), y).backward()
        opt.step()
    return opt, step


def issue_split(step, steps):
    """Medians over `steps` steps, each from an idle GPU, of (issue ms, ms in our passes (_crossing,
    whose calls run one pass, or a layer's two backward passes since session 37), ms in
    backends.run_pass, passes a step, passes a step on run_pass's full path); the passes that
    took the full path (backends.choose's calls: the prepared path skips it) by (pass, input shape),
    over all the steps; run_pass's host us a call by (pass, input shape, weight shape, backend that
    ran it); the pieces under the passes (PIECES: the launches, GEMMs, cuDNN calls, allocations
    and memory checks), each as (label, calls a step, us a call), over all the steps; and our
    crossings' ms a step by their passes ("fprop", "accgrad+bprop", ...; means)."""
    import statistics

    import torch

    from minitorch_fft import backends
    from minitorch_fft import pytorch as pt
    rows, full, spent, seen = [], Counter(), Counter(), Counter()
    piece_s, piece_n = Counter(), Counter()

    def by_pass(name, pass_name, *args, x_shape, w_shape, stride, padding, **_):
        return pass_name, tuple(x_shape), tuple(w_shape), stride, padding, name

    def by_crossing(backend, x_shape, w_shape, stride, padding, passes, *rest, **kwargs):
        return "+".join(p[0] for p in passes)
    crossings = Counter()
    for _ in range(steps):
        torch.cuda.synchronize()
        with contextlib.ExitStack() as stack:
            ours = stack.enter_context(Timed(pt, "_crossing", label=by_crossing))
            framework = stack.enter_context(Timed(backends, "run_pass", label=by_pass))
            chosen = stack.enter_context(Timed(backends, "choose",
                                               label=lambda name, pass_name, x_shape, *rest: (pass_name, x_shape)))
            pieces = [stack.enter_context(Timed(*where, label=label)) for where, label in _pieces()]
            t0 = time.perf_counter()
            step()
            issue = time.perf_counter() - t0
        rows.append((issue * 1e3, ours.seconds * 1e3, framework.seconds * 1e3, framework.calls, chosen.calls))
        full.update(chosen.seen)
        crossings.update(ours.spent)
        spent.update(framework.spent)
        seen.update(framework.seen)
        for timed in pieces:
            piece_s.update(timed.spent)
            piece_n.update(timed.seen)
    per_pass = []
    for (pass_name, x_shape, w_shape, stride, padding, name), seconds in spent.items():
        picked = backends.choose(name, pass_name, x_shape, w_shape, stride, padding, _cupy()).__name__.split(".")[-1]
        per_pass.append((seconds / seen[pass_name, x_shape, w_shape, stride, padding, name] * 1e6,
                         pass_name, x_shape, w_shape, picked))
    per_piece = sorted(((label, piece_n[label] / steps, piece_s[label] / piece_n[label] * 1e6) for label in piece_n),
                       key=lambda r: -r[1] * r[2])
    by_kind = [(kind, seconds * 1e3 / steps) for kind, seconds in crossings.most_common()]
    return tuple(statistics.median(col) for col in zip(*rows)), full, per_pass, per_piece, by_kind


def pass_peaks(step, top, crossings=False):
    """[(peak, start, label)] of one step's stretches with the highest peaks, in MiB above the
    step's start: each backends.run_pass call (label: pass, backend that ran it, shapes) and each
    stretch between two calls (label: "between ... and ..."), by the caching allocator's counters
    read and reset at each call's start and end; and the step's own peak. crossings: each of the
    adapter's crossings instead (minitorch_fft.pytorch._crossing: a layer's fprop, or its backward
    passes together; label: passes, each one's route where the layer is channels-last, shapes), which
    a channels-last layer's passes on cuDNN's NHWC plans go through and run_pass does not."""
    import torch

    from minitorch_fft import backends
    from minitorch_fft.backends import config
    from minitorch_fft import pytorch as pt
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    stretches, last = [], ["the step's start"]
    torch.cuda.reset_peak_memory_stats()

    def mib(b):
        return (b - base) / 2**20

    def close(label, start):
        stretches.append((mib(torch.cuda.max_memory_allocated()), mib(start), label))
        torch.cuda.reset_peak_memory_stats()

    def by_pass(name, pass_name, a, b, *rest, x_shape, w_shape, stride, padding, **kwargs):
        picked = backends.choose(name, pass_name, x_shape, w_shape, stride, padding, _cupy())
        return (f"{pass_name} {picked.__name__.split('.')[-1]} x {tuple(x_shape)} w {tuple(w_shape)}"
                f"{' (TF32)' if config.get('tf32') else ''}")

    def by_crossing(backend, x_shape, w_shape, stride, padding, passes, nhwc=False, bias=None):
        return (f"{'+'.join(p[0] for p in passes)}{' channels-last' if nhwc else ''} x {tuple(x_shape)} "
                f"w {tuple(w_shape)}{' (TF32)' if config.get('tf32') else ''}")
    module, name, label_of = (pt, "_crossing", by_crossing) if crossings else (backends, "run_pass", by_pass)
    inner, route_of = getattr(module, name), backends.nhwc_route
    between, depth, taken = [torch.cuda.memory_allocated()], [0], []

    def routed(pass_name, *args, **kwargs):   # the routes the crossing takes, as the adapter asks for them
        route = route_of(pass_name, *args, **kwargs)
        taken.append(f"{pass_name}->{route}")
        return route

    def recorded(*args, **kwargs):
        if depth[0]:   # a call inside a recorded one (_nchw_passes' _crossing): part of it
            return inner(*args, **kwargs)
        label = label_of(*args, **kwargs)
        close(f"between {last[0]} and {label}", between[0])
        start = torch.cuda.memory_allocated()
        depth[0], taken[:] = 1, []
        try:
            return inner(*args, **kwargs)
        finally:
            depth[0] = 0
            if taken:
                label += f" (routes {', '.join(taken)})"
            close(label, start)
            last[0], between[0] = label, torch.cuda.memory_allocated()
    setattr(module, name, recorded)
    backends.nhwc_route = routed
    try:
        step()
        torch.cuda.synchronize()
    finally:
        setattr(module, name, inner)
        backends.nhwc_route = route_of
    close(f"between {last[0]} and the step's end", between[0])
    step_peak = max(p for p, _, _ in stretches)
    return step_peak, sorted(stretches, reverse=True)[:top]


def _pieces():
    """[((object, attribute), label)]: what issue_split times under the passes, each call labelled."""
    import cupy

    from minitorch_fft.backends import cgemm, common, cudnn, fbfft_kernels, polyphase
    return [((cgemm, "_gemm"), lambda xp, a, b, out, op_a, op_b, *_: f"cgemm._gemm {a.shape} {op_a} {b.shape} {op_b} "
                                                                      f"({cgemm.mode(xp)})"),
            ((cudnn._Plan, "run"), lambda plan, cp, a, b, out, *_: f"cudnn plan run -> {out.shape}"),
            ((common, "check_fits"), lambda nbytes, *_: f"common.check_fits ({nbytes / 2**20:.0f} MiB)"),
            ((polyphase, "_launch"), lambda kind, *_: f"polyphase._launch {kind}"),
            ((fbfft_kernels, "rfft2_launcher"), lambda *_: "fbfft_kernels.rfft2_launcher (the look-up)"),
            ((fbfft_kernels, "irfft2_launcher"), lambda *_: "fbfft_kernels.irfft2_launcher (the look-up)"),
            ((fbfft_kernels, "_launcher"), lambda *_: "fbfft_kernels._launcher (the look-up)"),
            # as looked up at the call: cudnn's and gemm's prepared runs keep their own reference to
            # empty, taken at prepare(), and are not counted
            ((cupy, "empty"), lambda *a, **k: "cupy.empty")]


def _cupy():
    import cupy
    return cupy


def start_recording(entries):
    """The caching allocator records every allocation and free from here on, with Python stacks,
    the last `entries` of them (stop_recording ends it)."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=entries, stacks="python")


def stop_recording():
    """The trace since start_recording, on the current device; the recording ends either way."""
    import torch
    try:
        torch.cuda.synchronize()
        return torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def memory_trace(step):
    """The caching allocator's trace of one step (Python stacks recorded)."""
    start_recording(200_000)
    try:
        step()
    finally:
        trace = stop_recording()
    return trace


def memory_at_peak(step):
    """(peak MiB of one step above what was allocated before it, [(where, MiB)])."""
    return listed_at_peak(memory_trace(step))


def listed_at_peak(trace, top=12, key=None):
    """alive_at_peak(trace, key) in MiB: (peak MiB above the trace's start, [(where, MiB)], the `top`
    largest)."""
    peak, groups = alive_at_peak(trace, key)
    return peak / 2**20, [(w, b / 2**20) for w, b in groups.most_common(top)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--net", default="alexnet")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per row")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--output-code", action="store_true", help="inductor's code for the converted model, to stderr")
    ap.add_argument("--rows", default=",".join(ROWS),
                    help="comma-separated, of: " + ", ".join(ROWS) + ". A row profiled before another can "
                         "slow the other's host (a hypothesis of session 33: torch.profiler leaves CUPTI attached); "
                         "run one alone to compare")
    ap.add_argument("--python", type=int, default=0, metavar="N",
                    help="also list each row's Python functions with the most own time over N steps (cProfile)")
    ap.add_argument("--gaps", type=int, default=0, metavar="N",
                    help="also profile N steps, each from an idle GPU, and list where the GPU waits for the host "
                         "(idle gaps, by the host operator running at each gap's end)")
    ap.add_argument("--split", type=int, default=0, metavar="N",
                    help="also split each converted row's issue time over N steps into our passes' host time and "
                         "the rest")
    ap.add_argument("--passes", action="store_true",
                    help="also find which pass (or stretch between passes) each converted row's peak is in")
    ap.add_argument("--reset", action="store_true",
                    help="torch._dynamo.reset() before each row: every compiled row compiles in a fresh Dynamo "
                         "state (what an earlier row's compile leaves behind is the question it answers)")
    ap.add_argument("--left", action="store_true",
                    help="record each row from before its model is made through three steps: what it holds after "
                         "them (MiB, by where), and its peak to the KiB (a peak within a MiB of another's), each "
                         "in allocated bytes (the allocator's blocks) and requested ones (the sizes asked for)")
    ap.add_argument("--channels-last", action="store_true",
                    help="every row's model and input channels-last (the converted layers run cuDNN's NHWC plans)")
    ap.add_argument("--convert-channels-last", action="store_true",
                    help="the converted rows' model by convert(model, channels_last=True): the NCHW model run "
                         "channels-last inside, the stock rows NCHW (bench_pytorch --convert-channels-last)")
    ap.add_argument("--tf32", action="store_true",
                    help="PyTorch's TF32 defaults against the converted model in the framework's TF32 mode")
    ap.add_argument("--compile-mode", choices=("default", "reduce-overhead"), default="default",
                    help="torch.compile's mode for the compiled rows (reduce-overhead: inductor's CUDA graphs; the "
                         "peak and what is alive at it from the trees' recording step)")
    args = ap.parse_args()
    rows = [r.strip() for r in args.rows.split(",")]
    if any(r not in ROWS for r in rows):
        ap.error(f"unknown row in --rows {args.rows!r}; choose from {', '.join(ROWS)}")
    if args.convert_channels_last and args.channels_last:
        ap.error("--convert-channels-last converts an NCHW model; with --channels-last every model is channels-last "
                 "already")
    graphs = args.compile_mode == "reduce-overhead"
    if graphs and args.left:
        ap.error("--left does not go with --compile-mode reduce-overhead (its recorded steps would hold the trees' "
                 "recording step)")

    import torch

    from minitorch_fft import backends
    from minitorch_fft.pytorch import convert
    setup_cudnn(torch)                               # cuDNN's full search, as bench_pytorch's stock rows
    set_tf32("tf32" if args.tf32 else "strict")
    if args.tf32:
        backends.config.set("tf32", True)            # the whole run (the stock rows do not read it)
    torch.manual_seed(0)
    base = torch_model(args.net, 1000)
    side = IMAGE.get(args.net, 224)
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    x = torch.randn(args.batch, 3, side, side, device="cuda").contiguous(memory_format=layout)
    y = torch.randint(0, 1000, (args.batch,), device="cuda")
    summary = []
    for label in rows:
        converted, compiled = ROWS[label]
        if graphs:    # no earlier row's compiled model (the trees keep it) to be freed inside this one
            _free(torch)
        if args.reset or (compiled and NCHW_ROWS & set(rows)):
            # inductor's layout flag is not among Dynamo's guards: a row under the other flag could
            # reuse a graph compiled under this one
            torch._dynamo.reset()
        torch.cuda.synchronize()
        start = held(torch)                          # (allocated, requested) bytes
        if args.left:   # from before the model is made through three steps
            start_recording(LEFT_ENTRIES)
        model = copy.deepcopy(base).cuda().to(memory_format=layout)
        if converted:
            convert(model, channels_last=args.convert_channels_last)
        if compiled:   # inductor reads it at compile time (the first step)
            torch._inductor.config.layout_optimization = label not in NCHW_ROWS
        run = torch.compile(model, mode=args.compile_mode if graphs else None) if compiled else model
        opt, step = training_step(model, run, x, y, converted, graphs=compiled and graphs)
        if compiled and converted and args.output_code:
            torch._logging.set_logs(output_code=True)
        t0 = time.perf_counter()
        step()                                       # tunes (auto), compiles
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        if args.left:
            step()
            step()
            torch.cuda.synchronize()
            kept = [now - before for now, before in zip(held(torch), start)]   # at the trace's end
            trace = stop_recording()
            left = alive_at_end(trace, key=where_and_inner)
            if len(trace) >= LEFT_ENTRIES:
                print(f"warning: the trace of {label} filled its {LEFT_ENTRIES} entries: its first allocations "
                      "are missing from the listing below")
        torch._logging.set_logs()
        recorded = None
        if compiled and graphs:   # the trees record at the second call: a replay's memory is what it allocates
            torch.cuda.reset_peak_memory_stats()
            before = held(torch)
            trace = memory_trace(step)
            recorded = (peak_held(torch)[0] - before[0]) / 2**20, *listed_at_peak(trace, args.top, where_and_call)
        if compiled:
            from torch._inductor.async_compile import shutdown_compile_workers
            shutdown_compile_workers()
        for _ in range(3):
            step()
        ms = median_ms(step, "torch", 0, args.steps)
        issue = median_ms(step, "cpu", 0, args.steps, before=torch.cuda.synchronize)
        torch.cuda.synchronize()
        # before the profiler's session (profile_step), whose residue slows a host's CUDA calls
        # unless TEARDOWN_CUPTI=1 (benchmarks/NOTES.md, session 25)
        split = issue_split(step, args.split) if args.split and converted and recorded is None else None
        kernel_ms, kernels, host = profile_step(step, 5, args.top)
        if recorded is None:
            torch.cuda.reset_peak_memory_stats()
            before = held(torch)
            step()
            torch.cuda.synchronize()
            peak = peak_held(torch)
            peak_mib = (peak[0] - before[0]) / 2**20
            replayed_mib, groups = memory_at_peak(step)
        else:
            peak_mib, replayed_mib, groups = recorded
        which = "the trees' recording step's" if recorded is not None else "the step's"
        print(f"\n## {label}: step {ms:.2f} ms, issue {issue:.2f} ms, kernels {kernel_ms:.2f} ms, "
              f"peak {peak_mib:.0f} MiB above {which} start (replayed {replayed_mib:.0f}), first step {first_s:.1f} s")
        print("kernels (ms a step):")
        for name, v in kernels:
            print(f"  {v:7.3f}  {name}")
        print("host operators (own ms a step):")
        for name, v in host:
            print(f"  {v:7.3f}  {name}")
        print("alive at the peak (MiB), by where it was allocated:")
        for w, mib in groups:
            print(f"  {mib:8.1f}  {w}")
        if args.left:
            mib = [f"{b / 2**20:.3f}" for b in (*peak, *before, *kept)]
            print(f"peak {mib[0]} MiB in all (requested {mib[1]}), {mib[2]} before the measured step (requested "
                  f"{mib[3]}); after three steps the row held {mib[4]} MiB it allocated (requested {mib[5]}; from "
                  "before its model was made: parameters, gradients, optimizer state and whatever else). Allocated "
                  "counts the allocator's blocks, requested the sizes asked for (bench_pytorch's docstring), as the "
                  "listing below does, by where:")
            for w, b in left.most_common(args.top * 2):
                print(f"  {b / 2**20:10.3f}  {w}")
        if args.gaps:
            idle, busy, span, gaps = gpu_gaps(step, args.gaps, args.top * 2)
            print(f"GPU idle {idle:.2f} ms a step of a {span:.2f} ms span (busy {busy:.2f}); idle by the host "
                  "operator running at each gap's end (ms a step, gaps a step):")
            for w, ms_, n in gaps:
                print(f"  {ms_:7.3f}  {n:5.1f}  {w}")
        if args.split and converted and recorded is not None:
            print("(--split: a replay runs none of our crossings on the host, so there is nothing to split)")
        if split is not None:
            (issue_ms, ours_ms, framework_ms, calls, full_calls), full, per_pass, per_piece, by_kind = split
            print(f"issue {issue_ms:.2f} ms a step ({args.split} steps from an idle GPU, medians): "
                  f"{ours_ms:.2f} in our crossings (minitorch_fft.pytorch._crossing; backends.run_pass "
                  f"{framework_ms:.2f} of it, {calls:.0f} calls: a channels-last pass on cuDNN's plans or the GEMM "
                  "route takes none), "
                  f"{issue_ms - ours_ms:.2f} outside them (PyTorch's autograd, dispatcher and compiled wrappers, the "
                  f"stock layers); {full_calls:.0f} passes a step on run_pass's full path (not prepared):")
            for (pass_name, x_shape), n in full.most_common():
                print(f"  {n / args.split:5.1f}  {pass_name} {x_shape}")
            print("our crossings by their passes, ms a step (means):")
            for kind, ms_ in by_kind:
                print(f"  {ms_:7.3f}  {kind}")
            print("backends.run_pass, host us a call (mean over the steps), by pass and the backend that ran it:")
            for us_, pass_name, x_shape, w_shape, picked in per_pass:
                print(f"  {us_:7.1f}  {pass_name:8s} {picked:10s} x {x_shape} w {w_shape}")
            print("pieces under the passes: ms a step, calls a step, us a call (nested calls counted in each):")
            for piece, calls, us_ in per_piece:
                print(f"  {calls * us_ / 1e3:6.3f}  {calls:5.1f}  {us_:7.1f}  {piece}")
        if args.passes and converted and recorded is not None:
            print("(--passes: a replay runs no pass, so none to time; the listing above names where each allocation "
                  "alive at the recording's peak was made)")
        elif args.passes and converted:
            step_peak, stretches = pass_peaks(step, args.top, crossings=args.channels_last or args.convert_channels_last)
            print(f"the highest stretches of one step (peak {step_peak:.0f} MiB above its start; MiB: peak, allocated at "
                  "the stretch's start, transient):")
            for p, start, what in stretches:
                print(f"  {p:8.0f}  {start:8.0f}  {p - start:7.0f}  {what}")
        if args.python:
            own_rows, ours = python_profile(step, args.python, args.top * 2)
            print(f"Python, own ms a step under cProfile ({args.python} steps; calls a step):")
            for own, calls, name in own_rows:
                print(f"  {own:7.3f}  {calls:6.1f}  {name}")
            print("the project's functions, cumulative ms a step under cProfile (calls a step):")
            for cumulative, calls, name in ours:
                print(f"  {cumulative:7.3f}  {calls:6.1f}  {name}")
        summary.append((label, ms, issue, kernel_ms, peak_mib))
        del model, run, opt, step
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    print(f"\n| {args.net} b{args.batch} | step ms | issue ms | kernels ms | peak MiB |\n|---|---|---|---|---|")
    for label, ms, issue, kernel_ms, peak in summary:
        print(f"| {label} | {ms:.2f} | {issue:.2f} | {kernel_ms:.2f} | {peak:.0f} |")


if __name__ == "__main__":
    main()

"""Experiment (not a benchmark of record): a torchvision model's training step (forward, backward,
SGD) under variants of the code, alternated in one process. A host-bound step's time follows the
host's speed, which drifts by 15 % and more between processes and within one (session 37: the same
converted AlexNet TF32 step issued in 7.3 to 9.2 ms in four runs of one call), so a change worth a
few per cent can only be seen side by side: each round times every variant once (the order rotated
from round to round), and each variant's ratio to the first is taken within a round, then the
median over rounds.

Variants (--variants, comma-separated; the first is the reference):
  stock       the stock model (PyTorch's convolutions), as bench_pytorch's stock rows
  converted   the converted model as the code stands
  check       converted, with the driver asked for its free memory before every prepared pass whose
              output is above common.CHECK_ABOVE_BYTES: the driver call the prepared path made before
              session 37, without the Python around it (_pool_holds, the pool look-ups): a lower bound
  two crossings   converted, a layer's backward crossing into the CuPy scope once per pass (as
              before session 37) instead of once for both
  old adapter converted, with the adapter's per-pass functions (ADAPTER_FUNCTIONS) as the file
              --old-adapter defines them (session 38: the file before its per-pass trims)
  unprepared fft  converted, fbfft's, polyphase's and tiledfft's passes through their pass functions
              as before session 67 (their prepare() answering None)
  one thread  converted, PyTorch's intra-op pool at one thread while its steps run (stock one thread:
              the stock model so)

Times per variant and round: the step's median (CUDA events, steps back to back after a wait) and
its issue time (the host clock around a step started on an idle GPU), medians over --steps steps.

  python -m benchmarks.experiments.exp_step_ab --net alexnet --tf32 --variants converted,check,stock
  python -m benchmarks.experiments.exp_step_ab --compile --variants "converted,old adapter" --old-adapter FILE
  python -m benchmarks.experiments.exp_step_ab --net alexnet --tf32 --variants "converted,unprepared fft,stock"
"""
import argparse
import contextlib
import copy
import statistics

from benchmarks.bench_pytorch import IMAGE
from benchmarks.experiments.exp_compile_gap import training_step
from benchmarks.harness import host_probe_ms, median_ms, set_tf32, setup_cudnn, torch_model


@contextlib.contextmanager
def _driver_check_per_pass():
    """Every prepared pass with an output above the threshold first asks the driver for its free
    memory (cudaMemGetInfo), as common.check_fits did there in the adapter, whose allocator is not
    CuPy's pool, before session 37."""
    from minitorch_fft import backends
    from minitorch_fft.backends import common
    call = backends._Prepared.__call__
    big = {}

    def checked(self, args, later=None):
        nbytes = big.get(id(self))
        if nbytes is None:
            name, x_shape, w_shape, stride, padding = self.where
            g = common.geometry(x_shape, w_shape, stride, padding)
            nbytes = big[id(self)] = backends._output_bytes(g, self.pass_name)
        if nbytes > common.CHECK_ABOVE_BYTES:
            self.cp.cuda.runtime.memGetInfo()
        return call(self, args, later)
    backends._Prepared.__call__ = checked
    try:
        yield
    finally:
        backends._Prepared.__call__ = call


@contextlib.contextmanager
def _two_crossings():
    """A layer's backward crosses into the CuPy scope once per pass, as before session 37 (the
    code of _grads then, through _run)."""
    from minitorch_fft import pytorch as pt
    grads = pt._grads

    def separate(gy, x, weight, stride, padding, backend, want_x, want_w, want_b):
        gb = gy.sum((0, 2, 3)) if want_b else None
        gx = gw = None
        if want_w:
            gw = pt._run("accgrad", backend, gy, x, x.shape, weight.shape, stride, padding,
                         later=("bprop",) if want_x else ())
        if want_x:
            gx = pt._run("bprop", backend, gy, weight, x.shape, weight.shape, stride, padding, later=())
        return gx, gw, gb
    pt._grads = separate
    try:
        yield
    finally:
        pt._grads = grads


def make_steps(net, batch, tf32, kinds, compiled=False, channels_last=False):
    """{converted: step} for each kind in `kinds` (False: the stock model, True: converted): one
    training step each (training_step's) of the torchvision model `net` on one random batch, the
    kinds built from the same initial weights; TF32 as bench_pytorch's rows set it (`tf32`:
    PyTorch's defaults for stock, the framework's TF32 mode for converted), else strict fp32.
    compiled: each model runs under torch.compile (inductor), as in bench_pytorch's compiled rows but
    without their fresh Dynamo state per model (torch._dynamo.reset()): compile one kind a process.
    channels_last: models and input channels-last (bench_pytorch --channels-last)."""
    import torch

    from minitorch_fft import backends
    from minitorch_fft.pytorch import convert
    setup_cudnn(torch)
    set_tf32("tf32" if tf32 else "strict")
    if tf32:
        backends.config.set("tf32", True)
    torch.manual_seed(0)
    base = torch_model(net, 1000)
    side = IMAGE.get(net, 224)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(batch, 3, side, side, device="cuda").contiguous(memory_format=layout)
    y = torch.randint(0, 1000, (batch,), device="cuda")
    made = {}
    for converted in sorted(kinds):
        model = copy.deepcopy(base).cuda().to(memory_format=layout)
        if converted:
            convert(model)
        made[converted] = training_step(model, torch.compile(model) if compiled else model, x, y, converted)[1]
    return made


ADAPTER_FUNCTIONS = ("_array", "_crossing", "_pass", "_check_float32", "_autocast",
                     "_channels_last_passes", "_nchw_copy", "_nchw_array", "_pass_arrays", "_keeps",
                     "_nhwc_pass", "_gemm_prepared")
# (a name the other file lacks keeps the live module's function; one the live module lacks is removed after)
_old_adapter = [None]   # --old-adapter's path


@contextlib.contextmanager
def _adapter_from_file():
    """minitorch_fft.pytorch's ADAPTER_FUNCTIONS as another version of the file defines them
    (--old-adapter: e.g. the file at an earlier commit), defined into the live module, so that they
    share its state (the views of reuse_spectra(), the streams); the module's own are put back after.
    Only the functions are taken: executing the whole file would register the operators again."""
    import ast

    from minitorch_fft import pytorch as pt
    path = _old_adapter[0]
    if path is None:
        raise SystemExit("variant 'old adapter' needs --old-adapter PATH")
    with open(path) as f:
        tree = ast.parse(f.read())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ADAPTER_FUNCTIONS]
    saved = {name: pt.__dict__.get(name) for name in ADAPTER_FUNCTIONS}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), pt.__dict__)
    try:
        yield
    finally:
        for name, fn in saved.items():
            if fn is None:
                pt.__dict__.pop(name, None)
            else:
                pt.__dict__[name] = fn


@contextlib.contextmanager
def _unprepared_fft():
    """fbfft's, polyphase's and tiledfft's passes through their pass functions (bound), as run_pass ran
    them before session 67 gave them prepare() (tiledfft's in the session's second change: session 67's
    call 3 ran the variant without it): their prepare() answers None, and the prepared calls are made
    again on entry and on exit. The pass functions are today's, which the same session made cheaper
    too (polyphase's and tiledfft's launches worked out once per geometry, _launcher), so the variant
    understates the gain over the code before it. Under the pass_graphs setting the layers replay
    their graphs and the variant changes nothing; listed first, it is the one auto tunes through."""
    from minitorch_fft import backends
    from minitorch_fft.backends import fbfft, polyphase, tiledfft
    modules = (fbfft, polyphase, tiledfft)
    saved = [m.prepare for m in modules]
    for m in modules:
        m.prepare = lambda pass_name, g, xp: None
    backends._prepared.clear()
    try:
        yield
    finally:
        for m, prepare in zip(modules, saved):
            m.prepare = prepare
        backends._prepared.clear()


@contextlib.contextmanager
def _one_thread():
    """PyTorch's intra-op thread pool at one thread (torch.set_num_threads(1)) while the variant's steps
    run; its size put back after. On a 2-core CPU (exp_interleaved, session 68) the adapter's tiny NumPy
    crossing took 51-55 us in a loop of itself, 135-145 us with small PyTorch layers' forward and
    backward run between calls on one intra-op thread, 185-268 us on two (their threads spin after a
    parallel region, beside the caller's). A GPU step has few CPU operators; this asks whether it has any."""
    import torch
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(was)


VARIANTS = {"stock": (False, contextlib.nullcontext), "converted": (True, contextlib.nullcontext),
            "check": (True, _driver_check_per_pass), "two crossings": (True, _two_crossings),
            "old adapter": (True, _adapter_from_file), "unprepared fft": (True, _unprepared_fft),
            "one thread": (True, _one_thread), "stock one thread": (False, _one_thread)}
# name: (converted model, context around its steps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--net", default="alexnet")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--variants", default="converted,check")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant and round, for each figure")
    ap.add_argument("--tf32", action="store_true",
                    help="PyTorch's TF32 defaults for the stock model, the framework's TF32 mode for the converted")
    ap.add_argument("--compile", action="store_true",
                    help="the model under torch.compile (inductor); variants of one kind only, e.g. "
                         "'converted,old adapter' (the adapter's functions run below the compiled graph's operators)")
    ap.add_argument("--old-adapter", metavar="PATH", help="minitorch_fft/pytorch.py of another version, for "
                    "the variant 'old adapter'")
    ap.add_argument("--channels-last", action="store_true", help="models and input channels-last")
    args = ap.parse_args()
    _old_adapter[0] = args.old_adapter
    names = [v.strip() for v in args.variants.split(",")]
    if any(n not in VARIANTS for n in names) or len(set(names)) != len(names):
        ap.error(f"--variants {args.variants!r}: distinct names from {', '.join(VARIANTS)}")

    import torch

    kinds = {VARIANTS[n][0] for n in names}
    if args.compile and len(kinds) > 1:
        ap.error("--compile: the variants must all be stock or all converted (one Dynamo state a process)")
    made = make_steps(args.net, args.batch, args.tf32, kinds, args.compile, args.channels_last)
    steps = {n: made[VARIANTS[n][0]] for n in names}
    for n in names:                                   # tunes (auto), warms up
        with VARIANTS[n][1]():
            for _ in range(3):
                steps[n]()
    torch.cuda.synchronize()
    rows = {n: [] for n in names}                     # (step ms, issue ms) per round
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            with VARIANTS[n][1]():
                ms = median_ms(steps[n], "torch", 2, args.steps)
                issue = median_ms(steps[n], "cpu", 0, args.steps, before=torch.cuda.synchronize)
            rows[n].append((ms, issue))
        print(f"round {r + 1}: " + ", ".join(f"{n} {rows[n][-1][0]:.2f} / {rows[n][-1][1]:.2f} ms" for n in names),
              flush=True)
    ref = names[0]
    layout = ", channels-last" if args.channels_last else ""
    print(f"\n{args.net} b{args.batch} {'TF32' if args.tf32 else 'fp32'}{layout}, {torch.cuda.get_device_name()}, "
          f"{args.rounds} rounds x {args.steps} steps; ratios to {ref} paired by round (medians); "
          f"host probe {host_probe_ms():.2f} ms (harness.host_probe_ms)\n")
    print(f"| variant | step ms | issue ms | step / {ref} | issue / {ref} |\n|---|---|---|---|---|")
    for n in names:
        ms = statistics.median(v[0] for v in rows[n])
        issue = statistics.median(v[1] for v in rows[n])
        step_ratio = statistics.median(a[0] / b[0] for a, b in zip(rows[n], rows[ref]))
        issue_ratio = statistics.median(a[1] / b[1] for a, b in zip(rows[n], rows[ref]))
        print(f"| {n} | {ms:.2f} | {issue:.2f} | {step_ratio:.3f} | {issue_ratio:.3f} |")


if __name__ == "__main__":
    main()

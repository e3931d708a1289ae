"""session 13: where converted AlexNet's step peaks with reuse_spectra (1836-1870 MiB) against no
reuse (1419) and stock (1499). Per mode: memory at points of the step, what the StepCache and the
adapter's _views hold at the end of backward.

  PYTHONPATH=. MINITORCH_TUNE_CACHE=<a tuned cache> python3 benchmarks/experiments/exp_adapter_peak_passes.py"""
import contextlib, copy, functools, sys
import torch, torchvision
sys.path.insert(0, ".")
import backends
from backends import reuse
import minitorch_fft.pytorch as mp
from benchmarks.harness import set_tf32, setup_cudnn
setup_cudnn(torch); set_tf32("strict")
MiB = 2**20
torch.manual_seed(0)
base = torchvision.models.alexnet(num_classes=1000)
x = torch.randn(128, 3, 224, 224).cuda(); y = torch.randint(0, 1000, (128,)).cuda()
for mode in ("none", "inputs=True", "inputs=False", "none"):
    model = copy.deepcopy(base).cuda(); mp.convert(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scope = contextlib.nullcontext if mode == "none" else functools.partial(mp.reuse_spectra, inputs=mode == "inputs=True")
    marks = []
    def mark(what):
        torch.cuda.synchronize(); marks.append((what, torch.cuda.memory_allocated() / MiB, torch.cuda.max_memory_allocated() / MiB))
    orig_run = mp._run
    def run(pass_name, backend, a, b, *rest):
        out = orig_run(pass_name, backend, a, b, *rest)
        if recording:
            mark(f"{pass_name} {tuple(rest[1])}")
        return out
    mp._run = run
    recording = False
    def step(record):
        opt.zero_grad(set_to_none=False)
        with scope() as cache:
            out = model(x)
            if record: mark("after forward")
            loss = torch.nn.functional.cross_entropy(out, y)
            loss.backward()
            if record:
                mark("end of backward")
                if cache is not None:
                    ent = cache._entries
                    nb = sum(v[1].nbytes if hasattr(v[1], "nbytes") else sum(a.nbytes for a in v[1]) for v in ent.values())
                    print(f"  {mode}: StepCache holds {len(ent)} spectra, {nb / MiB:.0f} MiB: "
                          + ", ".join(f"{k[0].backend}/{k[0].role}/{k[0].basis}" for k in ent), flush=True)
                    vb = sum(a.nbytes for a in mp._views.values())
                    print(f"  {mode}: adapter _views holds {len(mp._views)} arrays, {vb / MiB:.0f} MiB: "
                          + ", ".join(str(tuple(a.shape)) for a in mp._views.values()), flush=True)
        opt.step()
        if record: mark("after opt.step")
    for _ in range(3):
        step(False)
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); marks.clear()
    mark("start")
    recording = True
    step(True)
    recording = False
    print(f"{mode}: peak {torch.cuda.max_memory_allocated() / MiB:.0f} MiB")
    for what, now, peak in marks:
        print(f"    {what:22s} allocated {now:7.0f}  max so far {peak:7.0f}")
    mp._run = orig_run
    del model, opt; torch.cuda.empty_cache()

"""session 13: converted ResNet-50 b128's step peak (13390 MiB) against stock's (11325): memory
allocated at the step's start, cufft's scratch buffers and plans, and where in the step the peak falls.

  PYTHONPATH=. MINITORCH_TUNE_CACHE=<a tuned cache> python3 benchmarks/experiments/exp_adapter_peak_resnet50.py"""
import contextlib, copy, gc, sys
import torch, torchvision
sys.path.insert(0, ".")
from backends import cufft_buffers as cb
import minitorch_fft.pytorch as mp
from benchmarks.harness import set_tf32, setup_cudnn
setup_cudnn(torch); set_tf32("strict")
MiB = 2**20
torch.manual_seed(0)
base = torchvision.models.resnet50(num_classes=1000)
x = torch.randn(128, 3, 224, 224).cuda(); y = torch.randint(0, 1000, (128,)).cuda()
orig_run = mp._run
for mode in ("stock", "converted", "converted, cufft buffers dropped each pass"):
    model = copy.deepcopy(base).cuda()
    if mode != "stock":
        mp.convert(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    marks, rec = [], [False]
    def run(pass_name, backend, a, b, *rest):
        before = torch.cuda.max_memory_allocated()
        out = orig_run(pass_name, backend, a, b, *rest)
        if "dropped" in mode:
            cb.release_buffers()
        if rec[0]:
            torch.cuda.synchronize()
            marks.append((torch.cuda.max_memory_allocated() - before, pass_name, tuple(rest[1]), tuple(rest[0]),
                          torch.cuda.memory_allocated() / MiB, torch.cuda.max_memory_allocated() / MiB))
        return out
    mp._run = run
    def step():
        opt.zero_grad(set_to_none=False)
        with (contextlib.nullcontext() if mode == "stock" else mp.reuse_spectra()):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if rec[0]:
                torch.cuda.synchronize(); fwd = torch.cuda.memory_allocated() / MiB
                print(f"  after forward: allocated {fwd:.0f} MiB, max so far {torch.cuda.max_memory_allocated() / MiB:.0f}")
            loss.backward()
        opt.step()
    for _ in range(3):
        step()
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated() / MiB
    scratch = sum(b.nbytes for b in cb._scratch_buffers.values()) / MiB
    print(f"{mode}: allocated at step start {start:.0f} MiB; cufft scratch {scratch:.0f} MiB in "
          f"{len(cb._scratch_buffers)} buffers, {len(cb._plans)} plans")
    rec[0] = True
    step()
    rec[0] = False
    print(f"{mode}: peak {torch.cuda.max_memory_allocated() / MiB:.0f} MiB")
    for inc, p, w, xs, now, mx in sorted(marks, reverse=True)[:6]:
        print(f"    peak +{inc / MiB:6.0f} MiB in {p:8s} w{w} x{xs}: allocated after {now:.0f}, max {mx:.0f}")
    mp._run = orig_run
    del model, opt; gc.collect(); cb.release_buffers(); torch.cuda.empty_cache()

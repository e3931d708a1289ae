"""session 13: converted AlexNet's peak as bench_pytorch measures it (median_ms over 10 steps after 2
warm-ups) against one recorded step (diag13b: inputs=False 1418 MiB, bench 1870).

  PYTHONPATH=. MINITORCH_TUNE_CACHE=<a tuned cache> python3 benchmarks/experiments/exp_adapter_peak_modes.py"""
import contextlib, copy, functools, gc, sys
import torch, torchvision
sys.path.insert(0, ".")
import minitorch_fft.pytorch as mp
from benchmarks.harness import median_ms, set_tf32, setup_cudnn
setup_cudnn(torch); set_tf32("strict")
MiB = 2**20
torch.manual_seed(0)
base = torchvision.models.alexnet(num_classes=1000)
x = torch.randn(128, 3, 224, 224).cuda(); y = torch.randint(0, 1000, (128,)).cuda()
for mode in ("stock", "none", "inputs=True", "inputs=False"):
    model = copy.deepcopy(base).cuda()
    if mode != "stock":
        mp.convert(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scope = (contextlib.nullcontext if mode in ("stock", "none")
             else functools.partial(mp.reuse_spectra, inputs=mode == "inputs=True"))
    def step():
        opt.zero_grad(set_to_none=False)
        with scope() as cache:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
        opt.step()
    res = []
    for variant in ("bench", "synced", "one step", "bench gc off"):
        for _ in range(2):
            step()
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        if variant == "bench":
            ms = median_ms(step, "torch", 0, 10)
        elif variant == "synced":
            ms = median_ms(lambda: (step(), torch.cuda.synchronize()), "torch", 0, 10)
        elif variant == "one step":
            step(); torch.cuda.synchronize(); ms = 0
        else:
            gc.disable(); ms = median_ms(step, "torch", 0, 10); gc.enable()
        res.append(f"{variant} {ms:.2f} ms peak {torch.cuda.max_memory_allocated() / MiB:.0f}")
    print(f"{mode:13s}: " + " | ".join(res), flush=True)
    del model, opt; gc.collect(); torch.cuda.empty_cache()

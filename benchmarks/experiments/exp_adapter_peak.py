"""Experiment: where a converted torchvision model's training step peaks in GPU memory, against the
stock model's (issue 19's target: at most the stock model's peak).

Session 13 asked why bench_pytorch gave converted AlexNet b128 1870 MiB with reuse_spectra(inputs=
False) where the prediction was ~1420, and converted ResNet-50 b128 13390 MiB against stock's 10968.
Answers (results/nvidia-h100-80gb-hbm3/experiments/exp_adapter_peak_*): measured alone, AlexNet's
step peaks at 1417 MiB (bench_pytorch counted what earlier rows and the row's own tuning left
allocated), and ResNet-50's at 10992 in a process that did not tune (auto's tuning left cufft's
scratch buffers grown). Two views:

  modes   per reuse mode (stock; converted without reuse; reuse_spectra(inputs=True); inputs=False):
          ms and peak over 10 steps after 2 warm-ups as bench_pytorch times them, synchronised
          after each step, one step, and with the garbage collector off
  passes  one recorded step per mode: memory allocated at its start, after forward, after each
          pass of ours (the passes that raised the peak most, first), and what the spectra cache
          (StepCache), the adapter's views and cufft's scratch buffers hold

  PYTHONPATH=. MINITORCH_TUNE_CACHE=<a tuned cache> python3 benchmarks/experiments/exp_adapter_peak.py modes --net alexnet
  PYTHONPATH=. MINITORCH_TUNE_CACHE=<a tuned cache> python3 benchmarks/experiments/exp_adapter_peak.py passes --net resnet50
  ... passes --net overfeat_fast --tf32 --modes stock inputs=False

--tf32 runs the stock model in PyTorch's default (cuDNN TF32) and the converted ones in the
framework's TF32 mode, as bench_pytorch's TF32 rows do (session 22: converted AlexNet's TF32 step
peaked 22 MiB above the stock default model's, OverFeat-fast's 0.9 GiB in session 14).

A cold tuning cache tunes in the first steps (minutes for ResNet-50); the warm-up steps absorb it.
Session 13 ran the first versions of these views as three scripts (exp_adapter_peak_modes.py,
_passes.py, _resnet50.py at bf3f002).
"""
import argparse
import contextlib
import copy
import functools
import gc

MiB = 2**20
MODES = ("stock", "none", "inputs=True", "inputs=False")


def setup(net, batch, precision):
    """(torch, model as bench_pytorch builds it, batch x, labels y), PyTorch in `precision`
    ("strict" or "tf32", harness.set_tf32)."""
    import torch

    from benchmarks.bench_pytorch import IMAGE
    from benchmarks.harness import set_tf32, setup_cudnn, torch_model
    setup_cudnn(torch)
    set_tf32(precision)
    torch.manual_seed(0)
    base = torch_model(net, 1000)
    side = IMAGE.get(net, 224)
    x = torch.randn(batch, 3, side, side).cuda()
    y = torch.randint(0, 1000, (batch,)).cuda()
    return torch, base, x, y


def trainer(torch, base, x, y, mode):
    """(step, model): one SGD step of the model in `mode` (MODES)."""
    from minitorch_fft import pytorch as mp
    model = copy.deepcopy(base).cuda()
    if mode != "stock":
        mp.convert(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scope = (contextlib.nullcontext if mode in ("stock", "none")
             else functools.partial(mp.reuse_spectra, inputs=mode == "inputs=True"))

    def step(after_forward=None, after_backward=None):
        opt.zero_grad(set_to_none=False)
        with scope() as cache:
            out = model(x)
            if after_forward:
                after_forward()
            torch.nn.functional.cross_entropy(out, y).backward()
            if after_backward:
                after_backward(cache)
        opt.step()
    return step, model


def modes(torch, base, x, y, chosen):
    from benchmarks.harness import median_ms
    for mode in chosen:
        step, model = trainer(torch, base, x, y, mode)
        res = []
        for variant in ("bench", "synced", "one step", "bench gc off"):
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if variant == "bench":
                ms = median_ms(step, "torch", 0, 10)
            elif variant == "synced":
                ms = median_ms(lambda: (step(), torch.cuda.synchronize()), "torch", 0, 10)
            elif variant == "one step":
                step()
                torch.cuda.synchronize()
                ms = float("nan")
            else:
                gc.disable()
                ms = median_ms(step, "torch", 0, 10)
                gc.enable()
            res.append(f"{variant} {ms:.2f} ms peak {torch.cuda.max_memory_allocated() / MiB:.0f}")
        print(f"{mode:13s}: " + " | ".join(res), flush=True)
        del step, model
        gc.collect()
        torch.cuda.empty_cache()


def passes(torch, base, x, y, chosen):
    from minitorch_fft.backends import auto, cufft_buffers
    from minitorch_fft import pytorch as mp
    real_run = mp._run
    for mode in chosen:
        step, model = trainer(torch, base, x, y, mode)
        marks, recording = [], [False]

        def run(pass_name, backend, a, b, *rest, **kw):   # mp._run(pass, backend, a, b, x_shape, w_shape, ...)
            before = torch.cuda.max_memory_allocated()
            out = real_run(pass_name, backend, a, b, *rest, **kw)
            if recording[0]:
                torch.cuda.synchronize()
                marks.append((torch.cuda.max_memory_allocated() - before, pass_name, tuple(rest[1]),
                               torch.cuda.memory_allocated() / MiB, torch.cuda.max_memory_allocated() / MiB))
            return out

        def forward_done():
            torch.cuda.synchronize()
            print(f"  after forward: allocated {torch.cuda.memory_allocated() / MiB:.0f} MiB, "
                  f"max so far {torch.cuda.max_memory_allocated() / MiB:.0f}")

        def backward_done(cache):
            if cache is None:
                return
            spectra = sum(sum(a.nbytes for a in (v[1] if isinstance(v[1], tuple) else (v[1],)))
                          for v in cache._entries.values())
            views = sum(a.nbytes for a in mp._views.values())
            print(f"  end of backward: the spectra cache holds {len(cache._entries)} ({spectra / MiB:.0f} MiB), "
                  f"the adapter's views {len(mp._views)} ({views / MiB:.0f} MiB): "
                  + ", ".join(str(tuple(a.shape)) for a in mp._views.values()))

        mp._run = run
        try:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            scratch = sum(b.nbytes for b in cufft_buffers._scratch_buffers.values()) / MiB
            work = sum(_work_area_bytes(p) for p in cufft_buffers._plans.values()) / MiB
            print(f"{mode}: allocated at the step's start {torch.cuda.memory_allocated() / MiB:.0f} MiB; "
                  f"cufft scratch {scratch:.0f} MiB in {len(cufft_buffers._scratch_buffers)} buffers "
                  f"({', '.join(f'{k[0]} {b.nbytes / MiB:.0f}' for k, b in cufft_buffers._scratch_buffers.items())}), "
                  f"{len(cufft_buffers._plans)} plans with {work:.0f} MiB of work areas")
            recording[0] = True
            step(forward_done, backward_done)
            recording[0] = False
        finally:
            mp._run = real_run
        print(f"{mode}: peak {torch.cuda.max_memory_allocated() / MiB:.0f} MiB")
        for raised, pass_name, w_shape, now, peak in sorted(marks, reverse=True)[:6]:
            print(f"    peak +{raised / MiB:6.0f} MiB in {pass_name:8s} w{w_shape}: allocated after {now:.0f}, "
                  f"max {peak:.0f}")
        if mode != "stock":
            print(auto.format_choices())
        del step, model
        gc.collect()
        cufft_buffers.release_buffers()
        torch.cuda.empty_cache()


def _work_area_bytes(plan):
    """A CuPy cuFFT plan's work area (device memory it holds while cached); 0 where it has none."""
    area = getattr(plan, "work_area", None)
    return getattr(getattr(area, "mem", None), "size", 0) if area is not None else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("view", choices=("modes", "passes"))
    ap.add_argument("--net", default="alexnet", choices=("alexnet", "vgg16", "resnet50", "overfeat_fast"))
    ap.add_argument("--batch", type=int, default=None, help="default: bench_pytorch's for the network")
    ap.add_argument("--tf32", action="store_true",
                    help="stock in PyTorch's default (cuDNN TF32), converted in the framework's TF32 mode")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = ap.parse_args(argv)
    from minitorch_fft import backends
    from benchmarks.bench_pytorch import BATCH
    torch, base, x, y = setup(args.net, args.batch or BATCH[args.net], "tf32" if args.tf32 else "strict")
    with backends.config.override(tf32=args.tf32):
        {"modes": modes, "passes": passes}[args.view](torch, base, x, y, args.modes)


if __name__ == "__main__":
    main()

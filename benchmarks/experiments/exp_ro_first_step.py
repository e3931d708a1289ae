"""Experiment: a converted model's first steps under torch.compile(mode="reduce-overhead") (session 55).

exp_compile_gap's converted reduce-overhead rows failed at their first step with "Detected N
tensor(s) in the cudagraph pool not tracked as outputs"; bench_pytorch's never did (an eager row runs
first). This converts a zoo model, optionally takes one eager step, compiles it with reduce-overhead
and takes four steps, inside reuse_spectra() or not, with the cudagraph trees' allocation history on,
so that a refusal names where the untracked allocations were made (our frames kept). Each step is
compared with the same step of an eager copy (largest parameter difference over the largest
parameter). The torchvision-style AlexNet and OverFeat-fast have Dropout, whose masks the compiled
and eager models draw differently: the comparison is no correctness check for them (the GPU test
test_reduce_overhead_first_step_drops_a_gy_spectrum_bprop_did_not_take is, on a net without dropout).

  PYTHONPATH=. python3 benchmarks/experiments/exp_ro_first_step.py NET strict|tf32 EAGER_FIRST(0|1) SCOPE(0|1|2)

SCOPE: 0 no reuse_spectra block, 1 reuse_spectra() (inputs=False, the adapter's default), 2 inputs=True.
"""
import contextlib
import copy
import sys


def main():
    import torch
    import torch._inductor.config as inductor_config

    from benchmarks.harness import set_tf32, setup_cudnn, torch_model
    from minitorch_fft import backends
    from minitorch_fft.pytorch import convert, reuse_spectra
    net, mode, eager_first, scope_on = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] != "0"
    inputs = sys.argv[4] == "2"
    inductor_config.triton.cudagraph_trees_history_recording = True
    setup_cudnn(torch)
    set_tf32(mode)
    backends.config.set("tf32", mode == "tf32")
    torch.manual_seed(0)
    model = convert(torch_model(net, 1000).cuda())
    side = 231 if net == "overfeat_fast" else 224
    x = torch.randn(128, 3, side, side, device="cuda")
    y = torch.randint(0, 1000, (128,), device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scope = (lambda: reuse_spectra(inputs=inputs)) if scope_on else contextlib.nullcontext
    if eager_first:
        opt.zero_grad()
        with scope():
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        torch.cuda.synchronize()
    eager = copy.deepcopy(model)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.01, momentum=0.9)
    opt_eager.load_state_dict(copy.deepcopy(opt.state_dict()))   # its own momentum buffers
    run = torch.compile(model, mode="reduce-overhead")
    print(f"== {net} {mode} eager_first={eager_first} reuse_spectra={scope_on} inputs={inputs}")
    try:
        for i in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            opt.zero_grad(set_to_none=True)
            with scope():
                torch.nn.functional.cross_entropy(run(x), y).backward()
            opt.step()
            opt_eager.zero_grad(set_to_none=True)
            with scope():
                torch.nn.functional.cross_entropy(eager(x), y).backward()
            opt_eager.step()
            torch.cuda.synchronize()
            with torch.no_grad():
                d = max(float((p - q).abs().max() / q.abs().max()) for p, q in zip(model.parameters(),
                                                                                   eager.parameters()))
            print(f"step {i} ok, parameters' largest relative difference from eager steps {d:.2e}")
    except RuntimeError as e:
        msg = str(e)
        print("FAILED:", msg[:200].replace("\n", " | "))
        for line in msg.splitlines():   # the allocation histories: our frames and CuPy's
            if "minitorch_fft" in line or "cupy" in line or "Data Pointer" in line or "pytorch.py" in line:
                print("   ", line.strip()[:220])


if __name__ == "__main__":
    main()

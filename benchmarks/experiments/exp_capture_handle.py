"""Experiment (not a benchmark of record): may PyTorch make its cuBLAS handle inside a CUDA graph capture?

The PyTorch adapter captures its GEMMs on PyTorch's own cuBLAS handle (backends.cgemm.BorrowedHandle),
and PyTorch makes a thread's handle at its first GEMM there: in a converted model with no GEMM of
PyTorch's before the capture, inside it. Each mode runs in a fresh process (no handle yet):

  mm              a first torch.mm inside torch.cuda.graph (global capture mode, its default)
  handle          torch.cuda.current_blas_handle() inside the capture, then a torch.mm
  handle_relaxed  the same with the thread's capture mode relaxed around the handle's making
                  (cgemm.relaxed_capture_mode: the driver's cuThreadExchangeStreamCaptureMode)
  eager_cost      what making the handle outside a capture costs: PyTorch's allocator (the
                  workspace it binds) and the device's free memory (the handle's own)
  identity        the libcublas files loaded, and whether PyTorch calls the one CuPy's GEMMs use
                  (cgemm.shares_libcublas, through minitorch_fft.pytorch)
  conv_only_*     a converted network with no GEMM of PyTorch's (convolutions on gemm and fbfft,
                  ReLU, a mean): its training step captured after one eager step, and what the
                  capture took (PyTorch's allocator: the step's peak over the memory before it, and
                  the graph pool's reserve; the device's free memory) with the GEMMs on PyTorch's
                  handles (borrowed; its forward and its backward run on two threads, each with
                  its handle) or on the adapter's own handle (own)

Session 36 (H200, torch 2.11): mm and handle invalidate the capture; handle_relaxed captures and
replays exactly; the handle costs 32 MiB of PyTorch's allocator and 98 MiB of device memory.

  python -m benchmarks.experiments.exp_capture_handle [--modes mm,handle,...]
"""
import argparse
import subprocess
import sys

MODES = ("mm", "handle", "handle_relaxed", "eager_cost", "identity", "conv_only_borrowed", "conv_only_own")


def one(mode):
    """Run one mode in this process (fresh: no cuBLAS handle of PyTorch's yet); prints a line."""
    import torch
    a = torch.randn(256, 256, device="cuda")
    torch.cuda.synchronize()
    if mode == "eager_cost":
        free0, _ = torch.cuda.mem_get_info()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        torch.cuda.current_blas_handle()
        torch.cuda.synchronize()
        free1, _ = torch.cuda.mem_get_info()
        print(f"eager_cost: allocated +{(torch.cuda.memory_allocated() - allocated) / 2**20:.3f} MiB, reserved "
              f"+{(torch.cuda.memory_reserved() - reserved) / 2**20:.3f} MiB, device free "
              f"-{(free0 - free1) / 2**20:.3f} MiB")
        return
    if mode.startswith("conv_only"):
        conv_only(torch, borrow=mode == "conv_only_borrowed")
        return
    if mode == "identity":
        import cupy
        cupy.ones(4) @ cupy.ones(4)                 # CuPy loads its libcublas
        from minitorch_fft.backends import cgemm
        from minitorch_fft import pytorch as pt
        print("identity: libcublas files", cgemm._libcublas_paths(), "torch shares:", pt._torch_shares_libcublas())
        return
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    try:
        with torch.cuda.graph(graph, stream=stream):
            if mode == "handle_relaxed":
                from minitorch_fft.backends import cgemm
                with cgemm.relaxed_capture_mode():
                    torch.cuda.current_blas_handle()
            elif mode == "handle":
                torch.cuda.current_blas_handle()
            c = a @ a
        graph.replay()
        torch.cuda.synchronize()
        print(f"{mode}: capture OK, replay error {(c - a @ a).abs().max().item():.2e}")
    except Exception as e:  # noqa: BLE001 - the finding, reported
        print(f"{mode}: FAILED {type(e).__name__}: {str(e)[:300]}")


def conv_only(torch, borrow):
    """conv_only_* (module docstring): prints what the capture of the step took."""
    from minitorch_fft import pytorch as pt
    from minitorch_fft.pytorch import Conv2d
    if not borrow:
        pt._torch_shares_libcublas = lambda: False      # this process only: the adapter's own handle
    torch.manual_seed(0)
    net = torch.nn.Sequential(Conv2d(3, 8, 3, padding=1, backend="gemm"), torch.nn.ReLU(),
                              Conv2d(8, 4, 3, padding=1, backend="fbfft")).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 3, 12, 12, device="cuda")

    def step():
        opt.zero_grad(set_to_none=False)
        net(x).square().mean().backward()
        opt.step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    free0, _ = torch.cuda.mem_get_info()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    mib = 2**20
    print(f"conv_only_{'borrowed' if borrow else 'own'}: handles "
          f"{'borrowed' if pt._graph_handles[torch.cuda.current_device()] is None else 'our own'}; the capture's peak "
          f"+{(torch.cuda.max_memory_allocated() - allocated) / mib:.3f} MiB allocated, reserved "
          f"+{(torch.cuda.memory_reserved() - reserved) / mib:.3f} MiB, device free -{(free0 - free1) / mib:.3f} MiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)   # the child process's mode
    args = ap.parse_args()
    if args.one:
        one(args.one)
        return
    modes = [m.strip() for m in args.modes.split(",")]
    if any(m not in MODES for m in modes):
        ap.error(f"unknown mode in --modes {args.modes!r}; choose from {', '.join(MODES)}")
    for mode in modes:
        run = subprocess.run([sys.executable, "-m", "benchmarks.experiments.exp_capture_handle", "--one", mode],
                             capture_output=True, text=True, timeout=120)
        print(run.stdout.strip() or f"{mode}: exit {run.returncode} {run.stderr[-500:]}")


if __name__ == "__main__":
    main()

"""Experiment (not a benchmark of record): what one adapter crossing costs the host in a loop of itself
against with other Python run between its calls. Sessions 37 and 67 found every host call of the
converted step 2-4x dearer inside a training step than timed alone on the device, under every
circumstance tried; this asks whether interleaving alone does it, on any machine.

The crossing is minitorch_fft.pytorch's fprop on the CPU path (a 1x2x3x3 input, a 2x2x1x1 weight, on
gemm: Python dominates it). "Between" runs a forward and backward of --layers tiny PyTorch blocks
(Linear, ReLU, LayerNorm on a 2x4 batch) before each timed call. --threads sets PyTorch's intra-op
pool (torch.set_num_threads; 0 leaves its default), whose threads spin for a while after a parallel
region beside the caller on a small machine.

  python -m benchmarks.experiments.exp_interleaved --threads 1
  python -m benchmarks.experiments.exp_interleaved
"""
import argparse
import statistics
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="PyTorch's intra-op threads (0: its default)")
    ap.add_argument("--layers", type=int, default=30, help="tiny blocks run between the calls")
    ap.add_argument("--calls", type=int, default=300, help="timed calls a figure")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.threads < 0 or args.layers < 1 or args.calls < 1 or args.rounds < 1:
        ap.error("--threads >= 0, --layers, --calls and --rounds >= 1")

    import os

    import torch

    from minitorch_fft import pytorch as pt
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x, w = torch.randn(1, 2, 3, 3), torch.randn(2, 2, 1, 1)

    def crossing():
        return pt._run("fprop", "gemm", x, w, x.shape, w.shape, [1, 1], [0, 0])
    block = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.LayerNorm(4))
             for _ in range(args.layers)]
    other_model, batch = torch.nn.Sequential(*block), torch.randn(2, 4)

    def other():
        other_model(batch).sum().backward()

    def timed(before):
        times = []
        for _ in range(args.calls):
            before()
            t0 = time.perf_counter()
            crossing()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6
    crossing()
    other()
    print(f"{os.cpu_count()} CPUs, {torch.get_num_threads()} intra-op threads, torch {torch.__version__}; "
          f"us a crossing, medians of {args.calls} calls")
    print("| round | alone | other Python between calls | ratio |\n|---|---|---|---|")
    for r in range(args.rounds):
        alone, between = timed(lambda: None), timed(other)
        print(f"| {r + 1} | {alone:.1f} | {between:.1f} | {between / alone:.2f} |")


if __name__ == "__main__":
    main()

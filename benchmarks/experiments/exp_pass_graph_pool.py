"""Experiment (not a benchmark of record): what fills the pass graphs' pool (minitorch_fft.pytorch)?

Session 48, calls 1-2: converted AlexNet b128's pass graphs held a pool of 486 MiB (338-374 MiB with
only conv3-5 graphed, under a cap on the graphed layers' tensors since removed), and the converted
eager rows' peaks were that much over their eager steps'. This runs bench_pytorch's step (forward,
loss, backward inside reuse_spectra(), SGD) with pass graphs on until a step captures nothing, and
reports:
- each capture: the layer and passes, and the arena's and the pool's bytes before and after it (what
  it added: the arena is made at the first capture, and anew where a later count outgrows it; the
  pool takes what does not fit the arena, and PyTorch's own allocations in a capture), with the
  arena's bytes the capture reached, beside the footprint its layer's eager count gave;
- the pool's segments at the end: each one's bytes, and its blocks in use between replays (what stays
  allocated in the pool: a backend buffer or workspace made during a capture) and free;
- the step's peak allocated bytes with the pool beside it, and the eager step's peak without graphs;
- each layer's passes' temporaries as counted in their eager calls (what the pass_graph_mb setting
  bounds), and whether they were captured;
- with --limits, the same again under each of those pass_graph_mb bounds.

  MINITORCH_TUNE_CACHE=/tmp/t.json python -m benchmarks.experiments.exp_pass_graph_pool [--tf32] \
      [--limits 64,128,256] [--net resnet50 --channels-last]
"""
import argparse
import copy


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--net", default="alexnet")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--tf32", action="store_true", help="TF32 mode (PyTorch's TF32 default for the rest)")
    ap.add_argument("--channels-last", action="store_true", help="the model and input channels-last")
    ap.add_argument("--limits", default="", help="comma-separated pass_graph_mb bounds (MiB > 0) to run too")
    args = ap.parse_args()
    try:
        limits = [float(v) for v in args.limits.split(",") if v]
    except ValueError:
        ap.error(f"--limits takes numbers, comma-separated, got {args.limits!r}")
    if any(not 0 < v < float("inf") for v in limits):
        ap.error(f"--limits takes MiB > 0, got {args.limits!r}")

    import torch

    from minitorch_fft import backends
    from benchmarks.harness import set_tf32, setup_cudnn, torch_model
    from minitorch_fft import pytorch as pt

    setup_cudnn(torch)
    set_tf32("tf32" if args.tf32 else "strict")
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    base = torch_model(args.net, 1000).to(memory_format=layout)
    x = torch.randn(args.batch, 3, 224, 224).cuda().contiguous(memory_format=layout)
    y = torch.randint(0, 1000, (args.batch,)).cuda()
    mib = 2.0**-20

    def run(graphs, limit=None):
        model = pt.convert(copy.deepcopy(base).cuda())
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step():
            opt.zero_grad(set_to_none=False)
            with pt.reuse_spectra():
                torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        captures, real = [], pt._capture

        def capture(backend, geometry, passes, *rest):
            before = pt.pass_graph_stats()
            for arena in pt._arenas.values():
                arena.high = 0   # from here: what this capture cuts
            graph = real(backend, geometry, passes, *rest)
            kind = next(reversed(pt._pass_graphs))[1]   # the capturing key: _graphed put it last
            used = (0 if graph[3] is None else graph[3].high, pt._footprints.get(kind, 0))
            captures.append((pt._what(backend, geometry, [(p, later) for p, _, _, later in passes]), before,
                             pt.pass_graph_stats(), used))
            return graph
        pt._capture = capture
        try:
            with backends.config.override(tf32=args.tf32, pass_graphs=graphs, pass_graph_mb=limit):
                for _ in range(3):
                    step()
                for _ in range(8):
                    warming = pt.pass_graph_stats()
                    step()
                    now = pt.pass_graph_stats()
                    if all(now[k] == warming[k] for k in ("eager", "captures", "failed")):
                        break
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated()
                stats = pt.pass_graph_stats()   # in the block: "over" is judged by its bound
        finally:
            pt._capture = real
        pools = {pool for _, pool in pt._capture_on.values()}
        segments = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) in pools]
        label = ("pass graphs" + (f", pass_graph_mb {limit:g}" if limit else "")) if graphs else "no pass graphs"
        label = ("channels-last, " if args.channels_last else "") + label
        print(f"\n== {args.net} b{args.batch} {'TF32' if args.tf32 else 'fp32'}, {label}: step peak "
              f"{peak * mib:.0f} MiB allocated ({(peak - start) * mib:.0f} above the step's start; the arena "
              f"{stats['arena_bytes'] * mib:.0f} MiB of it), pool {stats['pool_bytes'] * mib:.0f} MiB; {stats}")
        for what, before, after, (high, footprint) in captures:
            print(f"  capture {what:70s} arena {before['arena_bytes'] * mib:7.1f} -> "
                  f"{after['arena_bytes'] * mib:7.1f} MiB (its most used {high * mib:.1f}; this layer's "
                  f"footprint {footprint * mib:.1f}), pool {before['pool_bytes'] * mib:7.1f} -> "
                  f"{after['pool_bytes'] * mib:7.1f} MiB")
        graphed = {key[1] for key, entry in pt._pass_graphs.items() if entry.graphs}   # keys' kinds
        for kind, took in sorted(pt._temporaries.items(), key=lambda item: -item[1]):   # a layer's passes
            state = "captured" if kind in graphed else "eager"
            print(f"  temporaries {took * mib:8.1f} MiB  {state:8s} {pt._what(*kind[1:4])}")
        for s in segments:
            used = [b["size"] for b in s["blocks"] if b["state"] == "active_allocated"]
            free = [b["size"] for b in s["blocks"] if b["state"] != "active_allocated"]
            print(f"  segment {s['total_size'] * mib:8.1f} MiB: in use {len(used)} blocks "
                  f"{sum(used) * mib:.1f} MiB ({', '.join(f'{u * mib:.1f}' for u in sorted(used)[-4:])}), "
                  f"free {sum(free) * mib:.1f} MiB")
        pt.release_pass_graphs()
        backends.cufft.release_buffers()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    run(False)
    run(True)
    for limit in limits:
        run(True, limit)


if __name__ == "__main__":
    main()

"""test_pytorch's ResNet-18 check, taken apart (session 18): the converted torchvision ResNet-18
(10 classes, seed 0, eval mode, a batch of 2 at 64x64, generator seed 2) against the stock one in
fp32 and in float64, every parameter's gradient, in two passes in one process: the first tunes
auto's choices on the call's data, the second runs with them cached. Where only the first pass is
off, tuning itself disturbs the result; where both are, the choices are.

    python -m benchmarks.experiments.exp_adapter_resnet18 > $OUT/exp_adapter_resnet18.log
    MINITORCH_AUTO_BACKENDS=ours python -m benchmarks.experiments.exp_adapter_resnet18

--watch gpu|cpu: which memory changed. Every leaf module's output of the converted net is kept and
copied when forward makes it (on the GPU, or to the host: a copy there synchronises, which may hide
a race; a copy on the GPU allocates, which may move one), and every parameter before forward; after
backward each is compared with its copy. --bisect CACHE: one process per variant of the tuning cache
file CACHE (as it is, then without each gemm form record in turn), each on a copy of it, and a
line each: which record, when removed, makes the gradients right.

    python -m benchmarks.experiments.exp_adapter_resnet18 --bisect results/nvidia-h200/experiments/autotune_failing_state_649756e.json
"""
import argparse
import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def rel(a, b):
    a = np.asarray(a.detach().cpu().double().numpy() if hasattr(a, "detach") else a, np.float64)
    b = np.asarray(b.detach().cpu().double().numpy() if hasattr(b, "detach") else b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _watch(model, where):
    """Forward hooks keeping each leaf module's output and a copy of it ("gpu" or "cpu"), and the
    parameters' copies: check() names what changed since."""
    import torch
    kept, params = [], {n: p.detach().clone() for n, p in model.named_parameters()}

    def hook(mod, inp, out, name):
        if isinstance(out, torch.Tensor):
            kept.append((name, out, out.detach().clone() if where == "gpu" else out.detach().cpu()))
    for name, m in model.named_modules():
        if not list(m.children()):
            m.register_forward_hook(lambda mod, inp, out, name=name: hook(mod, inp, out, name))

    def check(label):
        torch.cuda.synchronize()
        moved = [f"{n} {rel(t, c):.1e}" for n, t, c in kept if not torch.equal(t.detach().to(c.device), c)]
        moved += [f"parameter {n} {rel(p, params[n]):.1e}" for n, p in model.named_parameters()
                  if not torch.equal(p.detach(), params[n])]
        print(f"  {label}: changed after forward ({where} copies): {', '.join(moved) or 'nothing'}")
    return check


def one_pass(label, watch=None):
    import torch
    import torch.nn.functional as TF
    import torchvision

    from minitorch_fft.pytorch import convert
    torch.manual_seed(0)
    stock = torchvision.models.resnet18(num_classes=10).cuda()
    ours = convert(copy.deepcopy(stock))
    check = _watch(ours, watch) if watch else None
    ref64 = copy.deepcopy(stock).double()
    nets = [m.eval() for m in (stock, ours, ref64)]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 64, 64, generator=g)
    y = torch.randint(0, 10, (2,), generator=g)
    outs = []
    for net in nets:
        dtype = next(net.parameters()).dtype
        out = net(x.to("cuda", dtype))
        TF.cross_entropy(out, y.cuda()).backward()
        outs.append(out)
    print(f"{label}: output vs stock {rel(outs[1], outs[0]):.2e}, vs float64 {rel(outs[1], outs[2]):.2e}")
    if check is not None:
        check(label)
    worst = []
    for (name, p), q, r in zip(ours.named_parameters(), stock.parameters(), ref64.parameters()):
        e, e64, es = rel(p.grad, q.grad), rel(p.grad, r.grad), rel(q.grad, r.grad)
        worst.append((e64, name))
        if e64 > 1e-5 or e > 1e-4 + es:
            print(f"  {label} {name}: vs stock {e:.2e}, vs float64 {e64:.2e} (stock vs float64 {es:.2e})")
    print(f"  {label}: every gradient vs float64, network order: "
          + ", ".join(f"{name} {e:.1e}" for e, name in worst))
    worst.sort(reverse=True)
    print(f"  {label}: worst vs float64 {worst[:3]}")


def bisect(cache):
    """One process per variant of the cache file: as it is, then without each gemm form record."""
    data = json.loads(open(cache).read())
    keys = [(d, k) for d, recs in data["devices"].items() for k in recs if "gemm_form" in k]
    variants = [("the cache as it is", None)] + [(f"without {k}", (d, k)) for d, k in keys]
    with tempfile.TemporaryDirectory(prefix="exp_adapter_bisect") as folder:
        for label, drop in variants:
            variant = copy.deepcopy(data)
            if drop is not None:
                del variant["devices"][drop[0]][drop[1]]
            path = Path(folder) / "tune.json"
            path.write_text(json.dumps(variant))
            res = subprocess.run([sys.executable, "-m", "benchmarks.experiments.exp_adapter_resnet18", "--first-only",
                                  "--tune-cache", str(path)], capture_output=True, text=True, timeout=300)
            worst = [line for line in res.stdout.splitlines() if "worst vs float64" in line]
            print(f"{label}: {worst[0].split('worst vs float64')[1][:90] if worst else res.stderr[-300:]}",
                  flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--watch", choices=("gpu", "cpu"), help="name the memory that changed after forward")
    p.add_argument("--bisect", metavar="CACHE", help="which gemm form record of CACHE the failure needs")
    p.add_argument("--tune-cache", help="the tuning cache file (default: the tune_cache setting's)")
    p.add_argument("--first-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bisect:
        return bisect(args.bisect)
    from backends import config
    with config.override(**({"tune_cache": args.tune_cache} if args.tune_cache else {})):
        run(args)


def run(args):
    import torch

    import backends
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    one_pass("first (tuning)", args.watch)
    if args.first_only:
        return
    print(backends.auto.format_choices())
    from backends import tuning
    path = tuning.cache_path()
    if path.exists():
        records = json.loads(path.read_text()).get("devices", {})
        for device, keys in records.items():
            for k, v in keys.items():
                if '"gemm' in k or "form" in k:
                    print(f"  cache {k}: {v.get('choice') if isinstance(v, dict) else v}")
    one_pass("second (cached)")


if __name__ == "__main__":
    main()

"""test_pytorch's ResNet-18 check, taken apart (session 18): the converted torchvision ResNet-18
(10 classes, seed 0, eval mode, a batch of 2 at 64x64, generator seed 2) against the stock one in
fp32 and in float64, every parameter's gradient, in two passes in one process: the first tunes
auto's choices on the call's data, the second runs with them cached. Where only the first pass is
off, tuning itself disturbs the result; where both are, the choices are.

    python -m benchmarks.experiments.exp_adapter_resnet18 > $OUT/exp_adapter_resnet18.log
    MINITORCH_AUTO_BACKENDS=ours python -m benchmarks.experiments.exp_adapter_resnet18
"""
import copy

import numpy as np


def rel(a, b):
    a = np.asarray(a.detach().cpu().double().numpy() if hasattr(a, "detach") else a, np.float64)
    b = np.asarray(b.detach().cpu().double().numpy() if hasattr(b, "detach") else b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def one_pass(label):
    import torch
    import torch.nn.functional as TF
    import torchvision

    from minitorch_fft.pytorch import convert
    torch.manual_seed(0)
    stock = torchvision.models.resnet18(num_classes=10).cuda()
    ours = convert(copy.deepcopy(stock))
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


def main():
    import torch

    import backends
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    one_pass("first (tuning)")
    print(backends.auto.format_choices())
    from backends import tuning
    path = tuning.cache_path()
    if path.exists():
        import json
        records = json.loads(path.read_text()).get("devices", {})
        for device, keys in records.items():
            for k, v in keys.items():
                if '"gemm' in k or "form" in k:
                    print(f"  cache {k}: {v.get('choice') if isinstance(v, dict) else v}")
    one_pass("second (cached)")


if __name__ == "__main__":
    main()

"""session 14: test_torchvision_network[resnet18-cuda] failed in call 1 (conv1.weight's gradient
8.1e-3 from stock's; stock 6.6e-7 from float64). (1) every backend, every pass, on every distinct conv
of the test's ResNet-18 with the test's real data (captured in float64), against float64; (2) the
test's check three times, fresh tuning each time, with every conv's error and auto's choices."""
import copy, sys, json
import numpy as np, cupy as cp, torch, torchvision
import torch.nn.functional as TF
sys.path.insert(0, "tests")
from minitorch_fft import backends
from minitorch_fft.backends import auto
torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
def rel(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64); return float(np.linalg.norm(a - b) / np.linalg.norm(b))
torch.manual_seed(0)
stock = torchvision.models.resnet18(num_classes=10).cuda().eval()
ref = copy.deepcopy(stock).double()
g = torch.Generator().manual_seed(2)
x = torch.randn(2, 3, 224, 224, generator=g); y = torch.randint(0, 10, (2,), generator=g)
caps = {}
def hook(name, m):
    def fwd(mod, inp, out):
        caps[name] = dict(x=inp[0].detach(), m=mod)
        out.register_hook(lambda gy: caps[name].__setitem__("gy", gy.detach()))
    m.register_forward_hook(fwd)
for n, m in ref.named_modules():
    if isinstance(m, torch.nn.Conv2d): hook(n, m)
TF.cross_entropy(ref(x.cuda().double()), y.cuda()).backward()
bad = []
for name, c in caps.items():
    m = c["m"]; x64, gy64, w64 = c["x"], c["gy"], m.weight.detach()
    s, p = tuple(m.stride), tuple(m.padding)
    xr = x64.clone().requires_grad_(); wr = w64.clone().requires_grad_()
    y64 = TF.conv2d(xr, wr, stride=s, padding=p)
    gx64, gw64 = torch.autograd.grad(y64, (xr, wr), gy64)
    x32, w32, gy32 = (cp.asarray(t.float().contiguous()) for t in (x64, w64, gy64))
    line = []
    for b in backends.names():
        be = backends.get(b)
        if not be.supports(x32.shape, w32.shape, s, p): continue
        try:
            e = (rel(cp.asnumpy(be.fprop(x32, w32, s, p)), y64.detach().cpu()),
                 rel(cp.asnumpy(be.bprop(gy32, w32, x32.shape, s, p)), gx64.cpu()),
                 rel(cp.asnumpy(be.accgrad(gy32, x32, w32.shape, s, p)), gw64.cpu()))
        except Exception as ex:
            line.append(f"{b}:ERR {type(ex).__name__}"); continue
        line.append(f"{b}:" + "/".join(f"{v:.0e}" for v in e))
        if max(e) > 1e-4: bad.append((name, b, e))
    print(f"{name:22} {tuple(x32.shape)} {tuple(w32.shape)} s{s} p{p}: " + " ".join(line), flush=True)
print("BAD (>1e-4):", bad)
from test_pytorch import network_check
from minitorch_fft.pytorch import convert
import os
for trial in range(3):
    auto._memory.clear(); os.environ["MINITORCH_TUNE_CACHE"] = f"/tmp/diag14b_tune_{trial}.json"
    try:
        network_check("resnet18", "cuda"); print("trial", trial, "passed")
    except AssertionError as e:
        print("trial", trial, "FAILED", str(e)[:200])
    ch = {str(k)[:140]: (v.get("choice"), {n: round(t, 3) for n, t in (v.get("ms") or {}).items()}, v.get("skipped")) for k, v in auto._memory.items()}
    for k, v in ch.items():
        if "(64, 3, 7, 7)" in k or v[2]: print("  ", k, v)

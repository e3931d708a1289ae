"""session 14: where accgrad_small's time goes (gemm's implicit accGrad form), on VGG-16 conv1_1 (b64)
and ResNet's conv1 (b128). Variants compiled from the kernel's own source: full, without the FMA loop
(fills only), without the global loads (constants; compute only), at 8 blocks per SM; and gemm's
whole implicit pass (its own grid, and the partials' sum).

  PYTHONPATH=. python3 benchmarks/experiments/exp_accgrad_small.py"""
from pathlib import Path
import numpy as np, cupy as cp
from minitorch_fft.backends import gemm
from minitorch_fft.backends.common import geometry, sm_count
from benchmarks.harness import median_ms
src = (Path(__file__).resolve().parents[2] / "minitorch_fft" / "backends" / "kernels" / "im2col.cu").read_text()
nocomp = src.replace("for (int q = 0; q < AG_TP; ++q) {\n            const float4 a", "for (int q = 0; q < (NOCOMP ? 0 : AG_TP); ++q) {\n            const float4 a")
noload = (src.replace("? gy[q_gy[q] + (long long)o * P] : 0.f", "? 1.f : 0.f")
          .replace("? x[q_img[q] + k_off[k] + iy * w + ix] : 0.f", "? 2.f : 0.f")
          .replace("*reinterpret_cast<const float4*>(gy + base + (long long)o * P + 4 * m)", "make_float4(1.f, 1.f, 1.f, 1.f)"))
assert nocomp != src and noload.count("make_float4(1.f") == 1
V = {"full": cp.RawModule(code=src, options=("--std=c++17",)),
     "fills_only": cp.RawModule(code=nocomp, options=("--std=c++17", "-DNOCOMP=1")),
     "compute_only": cp.RawModule(code=noload, options=("--std=c++17",))}
sms = sm_count(0)
for name, xs, ws, s, pd in (("vgg conv1_1 b64", (64, 3, 224, 224), (64, 3, 3, 3), (1, 1), (1, 1)),
                            ("r50 conv1 b128", (128, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3))):
    g = geometry(xs, ws, s, pd); K, P = g.f * g.kh * g.kw, g.oh * g.ow; total = g.S * P
    x = cp.random.standard_normal(xs, dtype=cp.float32); gy = cp.random.standard_normal((g.S, g.fo, g.oh, g.ow), dtype=cp.float32)
    bx, by, smem = gemm._implicit_block(g)
    k0 = V["full"].get_function("accgrad_small")
    print(f"{name}: block ({bx},{by}) smem {smem} regs {k0.num_regs} resident/SM {gemm._resident_blocks(k0, bx*by, smem)}; gemm.accgrad implicit "
          f"{median_ms(lambda: gemm._accgrad_implicit(cp, gy, x, g), 'cupy'):.3f} ms", flush=True)
    for per_sm in (8,):
        chunk = -(-total // (per_sm * sms)); chunk = -(-chunk // 32) * 32; nb = -(-total // chunk)
        part = cp.empty((nb, g.fo, K), cp.float32)
        args = (x, gy, part) + gemm._int32_args(g, g.S) + (np.int32(g.fo), np.int64(chunk), np.int32(P % 32 == 0))
        row = []
        for v, mod in V.items():
            k = mod.get_function("accgrad_small")
            row.append(f"{v} {median_ms(lambda: k((nb,), (bx, by), args, shared_mem=smem), 'cupy'):.3f}")
        print(f"  {per_sm:2d}/SM ({nb} blocks): " + ", ".join(row), flush=True)

"""session 16: where tiledfft's bprop time goes on ResNet's 64->64 56x56 3x3 layer (b128) and on three
VGG-16 layers (b64), and two changes to it measured side by side in one process.

1. The inverse: kernels/tiledfft.cu's tiledfft_irfft2 as committed (the output staged in shared
   memory, each row of a tile's block one store run) against the kernel before (each thread storing
   its own columns: runs of n/2 floats at most), compiled from the source given as argv[2] (the old
   tiledfft.cu with fbfft.cu inlined). Outputs compared element for element; GB/s = spectra read +
   output written over the time.
2. The frequency-domain GEMM: cgemm.matmul's complex GEMM (cuBLAS strided-batched, strict fp32)
   against the same product as a real SGEMM on the interleaved float32 view, A (nf, P, 2K) @ B' (nf,
   2K, 2N) with B' = [[Br, Bi], [-Bi, Br]] per element (B' built outside the timed span: it is the
   weights' spectrum, computed once a call). Same FLOPs; only the kernels cuBLAS picks differ.
3. The whole bprop per basis (tiledfft.bprop), the F(4x4) winograd and cuDNN strict (PyTorch).

  PYTHONPATH=. python3 benchmarks/experiments/exp_tiled_stages.py out.json tiledfft_old.cu"""
import json
import sys

import numpy as np, cupy as cp, torch
from minitorch_fft.backends import cgemm, fbfft_plan, tiledfft, winograd
from benchmarks.harness import median_ms, setup_cudnn, set_tf32, reference64, rel_error

setup_cudnn(torch); set_tf32("strict")
LAYERS = (("resnet 64 56^2", 128, 64, 56), ("vgg conv1_2", 64, 64, 224), ("vgg conv2_2", 64, 128, 112),
          ("vgg conv3_2", 64, 256, 56))
old_src = open(sys.argv[2]).read()
old_mod = cp.RawModule(code=old_src, options=("--std=c++17",), name_expressions=tiledfft.NAME_EXPRESSIONS)


def old_write_valid(yf, t, offset, out):
    S, fo, oh, ow = out.shape
    p = fbfft_plan.plan(t.n)
    B = yf.shape[1] * fo
    k = old_mod.get_function(f"tiledfft_irfft2<{t.n}>")
    k(((B + p.planes - 1) // p.planes,), (p.threads,),
      (yf, out, *(np.int32(v) for v in (B, fo, oh, ow, t.th, t.tw, t.mh, t.mw, *offset)), np.float32(1.0 / t.n ** 2)),
      shared_mem=p.smem_bytes)
    return out


def embed(wf):
    """(nf, K, N) complex -> (nf, 2K, 2N) float32 with [[Br, Bi], [-Bi, Br]] per element."""
    nf, K, N = wf.shape
    e = cp.empty((nf, K, 2, N, 2), dtype=cp.float32)
    e[:, :, 0, :, 0] = wf.real; e[:, :, 0, :, 1] = wf.imag
    e[:, :, 1, :, 0] = -wf.imag; e[:, :, 1, :, 1] = wf.real
    return e.reshape(nf, 2 * K, 2 * N)


rows = []
for name, S, c, hw in LAYERS:
    xs, ws = (S, c, hw, hw), (c, c, 3, 3)
    rng = cp.random.default_rng(0)
    w = rng.standard_normal(ws, dtype=cp.float32) / np.float32(np.sqrt(9 * c))
    gy = rng.standard_normal(xs, dtype=cp.float32)
    pad = (1, 1)                                           # bprop's: kh - 1 - ph
    flops = 2.0 * S * c * c * 9 * hw * hw
    r = dict(layer=name, S=S, c=c, hw=hw)
    for n in (16, 32):
        t = tiledfft.tiling((hw, hw), (3, 3), n)
        first = tiledfft._chunks(S, tiledfft._spectrum_bytes(t, 2 * c))[0]
        g1 = gy[first]
        out_new = cp.full((g1.shape[0], c, hw, hw), cp.nan, dtype=cp.float32)
        out_old = cp.full_like(out_new, cp.nan)
        wf = tiledfft._weight_spectrum(cp, w, n)
        gf = tiledfft._spectra(cp, g1, pad, t, (n, n))
        yf = cgemm.matmul(cp, gf, wf, op_b="N")
        tiledfft._write_valid(cp, yf, t, (2, 2), out_new)
        old_write_valid(yf, t, (2, 2), out_old)
        r[f"n{n}_images"] = int(g1.shape[0])
        r[f"n{n}_inverse_same"] = bool(cp.array_equal(out_new, out_old))
        r[f"n{n}_inverse_maxdiff"] = float(cp.nanmax(cp.abs(out_new - out_old)))
        r[f"n{n}_inverse_nans"] = [int(cp.isnan(out_new).sum()), int(cp.isnan(out_old).sum())]
        r[f"n{n}_forward_ms"] = median_ms(lambda: tiledfft._spectra(cp, g1, pad, t, (n, n)), "cupy")
        r[f"n{n}_gemm_ms"] = median_ms(lambda: cgemm.matmul(cp, gf, wf, op_b="N"), "cupy")
        we = embed(wf)
        ge = gf.view(cp.float32)
        ye = cgemm.matmul(cp, ge, we)
        r[f"n{n}_gemm_real_err"] = rel_error(ye.view(cp.complex64), yf)
        r[f"n{n}_gemm_real_ms"] = median_ms(lambda: cgemm.matmul(cp, ge, we), "cupy")
        r[f"n{n}_inverse_old_ms"] = median_ms(lambda: old_write_valid(yf, t, (2, 2), out_old), "cupy")
        r[f"n{n}_inverse_new_ms"] = median_ms(lambda: tiledfft._write_valid(cp, yf, t, (2, 2), out_new), "cupy")
        moved = yf.nbytes + out_new.nbytes
        r[f"n{n}_inverse_old_gbs"] = moved / r[f"n{n}_inverse_old_ms"] / 1e6
        r[f"n{n}_inverse_new_gbs"] = moved / r[f"n{n}_inverse_new_ms"] / 1e6
        r[f"n{n}_gemm_tflops"] = 8.0 * yf.shape[0] * yf.shape[1] * c * c / r[f"n{n}_gemm_ms"] / 1e9
        r[f"n{n}_gemm_real_tflops"] = 8.0 * yf.shape[0] * yf.shape[1] * c * c / r[f"n{n}_gemm_real_ms"] / 1e9
        r[f"n{n}_bprop_ms"] = median_ms(lambda: tiledfft.bprop(gy, w, xs, padding=(1, 1), basis=n), "cupy")
        print(f"{name:15} n={n:2d} ({g1.shape[0]} images): fwd {r[f'n{n}_forward_ms']:.3f}  gemm {r[f'n{n}_gemm_ms']:.3f} "
              f"({r[f'n{n}_gemm_tflops']:.1f} TF/s) real-embedded {r[f'n{n}_gemm_real_ms']:.3f} "
              f"({r[f'n{n}_gemm_real_tflops']:.1f} TF/s, diff {r[f'n{n}_gemm_real_err']:.1e})  inverse old "
              f"{r[f'n{n}_inverse_old_ms']:.3f} ({r[f'n{n}_inverse_old_gbs']:.0f} GB/s) new {r[f'n{n}_inverse_new_ms']:.3f} "
              f"({r[f'n{n}_inverse_new_gbs']:.0f} GB/s) same {r[f'n{n}_inverse_same']} (max diff {r[f'n{n}_inverse_maxdiff']:.1e}, NaNs {r[f'n{n}_inverse_nans']})  bprop {r[f'n{n}_bprop_ms']:.3f}",
              flush=True)
        del out_new, out_old, wf, gf, yf, we, ge, ye
        cp.get_default_memory_pool().free_all_blocks()
    ref = reference64(cp.zeros(xs, cp.float32), w, gy, (1, 1), (1, 1))["bprop"]
    r["bprop_err_n32"] = rel_error(tiledfft.bprop(gy, w, xs, padding=(1, 1), basis=32), ref)
    r["bprop_err_n16"] = rel_error(tiledfft.bprop(gy, w, xs, padding=(1, 1), basis=16), ref)
    del ref
    r["winograd_f4_ms"] = median_ms(lambda: winograd.bprop(gy, w, xs, padding=(1, 1), tile=4), "cupy")
    wt, gyt = torch.from_dlpack(w), torch.from_dlpack(gy)
    r["cudnn_ms"] = median_ms(lambda: torch.nn.grad.conv2d_input(xs, wt, gyt, padding=(1, 1)), "torch")
    best = min(r["n16_bprop_ms"], r["n32_bprop_ms"])
    print(f"{name:15} bprop: tiled16 {r['n16_bprop_ms']:.3f} tiled32 {r['n32_bprop_ms']:.3f} (err {r['bprop_err_n16']:.1e}, "
          f"{r['bprop_err_n32']:.1e}) F4 {r['winograd_f4_ms']:.3f} cudnn {r['cudnn_ms']:.3f}: best tiled vs cuDNN "
          f"{r['cudnn_ms'] / best:.3f}x, {flops / best / 1e9:.1f} TF/s", flush=True)
    rows.append(r)
    del w, gy, wt, gyt
    cp.get_default_memory_pool().free_all_blocks(); torch.cuda.empty_cache()
json.dump(rows, open(sys.argv[1], "w"), indent=1)

"""session 16: where winograd's accGrad time goes on VGG-16's 512-plane 3x3 layers (batch 64), the
layer-passes still at ~1.0x cuDNN strict (their best of ours is tiledfft, whose GEMM is already at the
fp32 rate with 18 % more products than F(4x4)). Per layer and tile: the stages of winograd._accgrad
(input transform, gradient transform, the grouped GEMM, the weight-gradient transform) timed apart,
with their bytes and FLOPs, beside the whole pass, tiledfft's accGrad (n = 16, 32) and cuDNN strict
(PyTorch, benchmark mode); every output's error against float64; and the device's SGEMM rate
(8192^3) and copy rate in the same run. Then the whole pass with the images cut into 1, 2, 4, 8
and 16 groups (accgrad_groups forced), beside accgrad_groups' own choice, also on ResNet's 64-plane
56^2 layer (b128) and OverFeat-fast's conv3 (256 -> 512, 12^2, b128), where auto takes winograd;
and (branch s16-winograd-groups-tuned) the pass with the count tuned among group_options.

  PYTHONPATH=. python3 benchmarks/experiments/exp_winograd_accgrad.py out.json"""
import json
import sys

import cupy as cp, torch
from minitorch_fft.backends import cgemm, config, tiledfft, winograd
from benchmarks.bench_winograd import ceilings
from benchmarks.harness import median_ms, reference64, rel_error, setup_cudnn, set_tf32

setup_cudnn(torch); set_tf32("strict")
LAYERS = (("vgg16 conv9", 64, 512, 512, 28), ("vgg16 conv11", 64, 512, 512, 14), ("vgg16 conv8", 64, 256, 512, 28),
          ("resnet 64 56^2", 128, 64, 64, 56), ("overfeat conv3", 128, 256, 512, 12))
peak, copy_gbs = ceilings(cp)
print(f"SGEMM 8192^3 {peak:.1f} TFLOP/s, copy {copy_gbs:.0f} GB/s", flush=True)
rows = []
for name, S, f, fo, hw in LAYERS:
    xs, ws = (S, f, hw, hw), (fo, f, 3, 3)
    rng = cp.random.default_rng(0)
    x = rng.standard_normal(xs, dtype=cp.float32)
    gy = rng.standard_normal((S, fo, hw, hw), dtype=cp.float32)
    ref = reference64(x, cp.zeros(ws, cp.float32), gy, (1, 1), (1, 1))["accgrad"]
    g = winograd.check_geometry(xs, ws, (1, 1), (1, 1))
    r = dict(layer=name, S=S, f=f, fo=fo, hw=hw, direct_gflop=2.0 * S * f * fo * 9 * hw * hw / 1e9)
    for m in winograd.TILES:
        alpha = m + 2
        th, tw = winograd.tiles(hw, hw, m)
        per_group, groups = winograd.accgrad_groups(g, m, S)
        layout = (groups, per_group * th * tw)
        v = winograd._input_transform(cp, x, (1, 1), th, tw, m, layout)
        z = winograd._gradient_transform(cp, gy, th, tw, m, layout)
        part = cp.empty((groups * alpha * alpha, fo, f), dtype=cp.float32)
        cgemm.matmul(cp, z, v, out=part, op_b="T")
        t = dict(groups=groups, tiles=S * th * tw, v_mb=v.nbytes / 1e6, z_mb=z.nbytes / 1e6, part_mb=part.nbytes / 1e6,
                 gemm_gflop=2.0 * alpha * alpha * fo * f * layout[1] * groups / 1e9)
        t["input_ms"] = median_ms(lambda: winograd._input_transform(cp, x, (1, 1), th, tw, m, layout), "cupy")
        t["gradient_ms"] = median_ms(lambda: winograd._gradient_transform(cp, gy, th, tw, m, layout), "cupy")
        t["gemm_ms"] = median_ms(lambda: cgemm.matmul(cp, z, v, out=part, op_b="T"), "cupy")
        t["weight_ms"] = median_ms(lambda: winograd._weight_gradient(cp, part, groups, m), "cupy")
        t["pass_ms"] = median_ms(lambda: winograd.accgrad(gy, x, ws, padding=(1, 1), tile=m), "cupy")
        t["err"] = rel_error(winograd.accgrad(gy, x, ws, padding=(1, 1), tile=m), ref)
        t["input_gbs"] = (x.nbytes + v.nbytes) / t["input_ms"] / 1e6
        t["gradient_gbs"] = (gy.nbytes + z.nbytes) / t["gradient_ms"] / 1e6
        t["gemm_tflops"] = t["gemm_gflop"] / t["gemm_ms"]
        r[f"F{m}"] = t
        print(f"{name:13} F({m}x{m}) {groups} group(s), {t['tiles']} tiles: input {t['input_ms']:.3f} ms "
              f"({t['input_gbs']:.0f} GB/s), gradient {t['gradient_ms']:.3f} ({t['gradient_gbs']:.0f} GB/s), GEMM "
              f"{t['gemm_ms']:.3f} ({t['gemm_tflops']:.1f} TF/s, {t['gemm_gflop']:.1f} GFLOP), weights {t['weight_ms']:.3f}; "
              f"sum {t['input_ms'] + t['gradient_ms'] + t['gemm_ms'] + t['weight_ms']:.3f}, pass {t['pass_ms']:.3f} "
              f"(err {t['err']:.1e})", flush=True)
        del v, z, part
        cp.get_default_memory_pool().free_all_blocks()
    own = winograd.accgrad_groups
    for m in winograd.TILES:
        sweep = {}
        for target in (1, 2, 4, 8, 16):
            per = -(-S // target)
            winograd.accgrad_groups = lambda g_, m_, images, per=per: (min(per, images), -(-images // min(per, images)))
            try:
                with config.override(winograd_tune="off"):   # the forced count, not a tuned one
                    sweep[target] = (median_ms(lambda: winograd.accgrad(gy, x, ws, padding=(1, 1), tile=m), "cupy"),
                                     rel_error(winograd.accgrad(gy, x, ws, padding=(1, 1), tile=m), ref))
            finally:
                winograd.accgrad_groups = own
        r[f"F{m}_groups_sweep"] = {k: {"ms": v[0], "err": v[1]} for k, v in sweep.items()}
        r[f"F{m}_own_groups"] = own(g, m, S)[1]
        r[f"F{m}_tuned_ms"] = median_ms(lambda: winograd.accgrad(gy, x, ws, padding=(1, 1), tile=m), "cupy")
        print(f"{name:13} F({m}x{m}) by groups: " + "  ".join(f"{k}: {v[0]:.3f} ms ({v[1]:.1e})" for k, v in sweep.items())
              + f"; accgrad_groups picks {r[f'F{m}_own_groups']}; tuned {r[f'F{m}_tuned_ms']:.3f} ms", flush=True)
    for n in (16, 32):
        r[f"tiled{n}_ms"] = median_ms(lambda: tiledfft.accgrad(gy, x, ws, padding=(1, 1), basis=n), "cupy")
    xt, gyt = torch.from_dlpack(x), torch.from_dlpack(gy)
    r["cudnn_ms"] = median_ms(lambda: torch.nn.grad.conv2d_weight(xt, ws, gyt, padding=(1, 1)), "torch")
    r["cudnn_err"] = rel_error(torch.nn.grad.conv2d_weight(xt, ws, gyt, padding=(1, 1)), ref)
    print(f"{name:13} tiled16 {r['tiled16_ms']:.3f} tiled32 {r['tiled32_ms']:.3f} cuDNN strict {r['cudnn_ms']:.3f} "
          f"(err {r['cudnn_err']:.1e}, {r['direct_gflop'] / r['cudnn_ms']:.0f} effective TFLOP/s)", flush=True)
    rows.append(r)
    del x, gy, ref, xt, gyt
    cp.get_default_memory_pool().free_all_blocks(); torch.cuda.empty_cache()
json.dump(dict(sgemm_tflops=peak, copy_gbs=copy_gbs, rows=rows), open(sys.argv[1], "w"), indent=1)

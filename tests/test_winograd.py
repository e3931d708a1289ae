"""The winograd backend against PyTorch float64: the NumPy path on the CPU (the kernels' tiling,
index arithmetic and layout), the CUDA kernels on the GPU; its matrices against exact arithmetic."""
import re
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings as hsettings
from hypothesis import strategies as st

from minitorch_fft import backends
from minitorch_fft.backends import winograd
from minitorch_fft.backends.common import KERNEL_DIR
from conftest import DEVICES
from reference import check_backend

TOL = 1e-5   # the auto-eligibility bound every variant must meet


def forced(m):
    """The backend with its tile size forced to m (check_backend calls the plain contract)."""
    return SimpleNamespace(
        fprop=lambda x, w, stride, padding: winograd.fprop(x, w, stride, padding, tile=m),
        bprop=lambda gy, w, xs, stride, padding: winograd.bprop(gy, w, xs, stride, padding, tile=m),
        accgrad=lambda gy, x, ws, stride, padding: winograd.accgrad(gy, x, ws, stride, padding, tile=m))


CASES = [  # (S, f, f', h, w, padding)
    (2, 3, 4, 8, 8, (1, 1)),         # planes a multiple of both tiles
    (2, 5, 3, 9, 13, (1, 1)),        # odd, rectangular: clipped last tiles
    (1, 2, 3, 3, 3, (0, 0)),         # one output element
    (3, 2, 2, 4, 7, (0, 2)),         # asymmetric padding
    (2, 3, 2, 6, 5, (3, 4)),         # padding beyond 2: bprop reads its gradient cropped
    (1, 1, 1, 1, 1, (1, 1)),         # a plane smaller than the kernel, padded
    (2, 4, 6, 17, 10, (2, 0)),       # tails in both directions, f' > f
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", winograd.TILES)
@pytest.mark.parametrize("case", CASES)
def test_three_passes_match_the_reference(device, m, case, rng):
    S, f, fo, h, w, pad = case
    x = rng.standard_normal((S, f, h, w)).astype(np.float32)
    wt = rng.standard_normal((fo, f, 3, 3)).astype(np.float32)
    check_backend(forced(m), x, wt, (1, 1), pad, device=device, tol=TOL, rng=rng)


@st.composite
def geometries_3x3(draw):
    ph, pw = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    h, w = draw(st.integers(max(1, 3 - 2 * ph), 23)), draw(st.integers(max(1, 3 - 2 * pw), 23))
    return (draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 6)), h, w, (ph, pw))


@pytest.mark.parametrize("m", winograd.TILES)
@hsettings(max_examples=40, deadline=None, derandomize=True, database=None,
           suppress_health_check=list(HealthCheck))
@given(geometries_3x3())
def test_random_geometries_match_the_reference(m, geom):
    S, f, fo, h, w, pad = geom
    rng = np.random.default_rng(hash(geom) % 2**32)
    x = rng.standard_normal((S, f, h, w)).astype(np.float32)
    wt = rng.standard_normal((fo, f, 3, 3)).astype(np.float32)
    check_backend(forced(m), x, wt, (1, 1), pad, tol=TOL, rng=rng)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workspace_mb, group_tiles", [(0.01, 4096), (0.026, 1), (64, 1)])
def test_chunks_and_accgrad_groups_match_the_reference(device, workspace_mb, group_tiles, settings, monkeypatch,
                                                        rng):
    """Every image its own chunk; chunks of 2-3 images cut into groups of one (the last chunk
    shorter: its GEMM fills a prefix of the groups' sums); one chunk of 5 groups."""
    settings(winograd_workspace_mb=workspace_mb)
    monkeypatch.setattr(winograd, "GROUP_TILES", group_tiles)
    x = rng.standard_normal((5, 4, 10, 12)).astype(np.float32)
    wt = rng.standard_normal((3, 4, 3, 3)).astype(np.float32)
    g = backends.geometry(x.shape, wt.shape, 1, 1)
    chunks = len(winograd._chunks(5, 16 * 5 * 6 * 7, 7 * 10 * 12, 2))     # F(2x2): 5 x 6 tiles
    assert chunks == {0.01: 5, 0.026: 3, 64: 1}[workspace_mb]
    assert winograd.accgrad_groups(g, 2, -(-5 // chunks))[1] == {0.01: 1, 0.026: 2, 64: 5}[workspace_mb]
    for m in winograd.TILES:
        check_backend(forced(m), x, wt, (1, 1), (1, 1), device=device, tol=TOL, rng=rng)


def test_accgrad_groups_fill_the_gpu_and_revision_marks_it(settings):
    """VGG-16's 512-plane layers at F(4x4) (36 matrices of 4 x 4 blocks: 576 < GEMM_BLOCKS) take two
    groups of 32 images; F(2x2) four (GROUP_TILES and the fill agree); a 224^2 plane one image a group
    (GROUP_TILES); a batch of one, one group; ResNet's 64-plane layer 26 groups of 5 (fill 29 does not
    divide 128); a workspace with room for one group's sums, one group. Each change to accGrad's
    speed raises its revision, and its tile is tuned anew."""
    settings(winograd_workspace_mb=2048.0)
    conv9 = backends.geometry((64, 512, 28, 28), (512, 512, 3, 3), 1, 1)
    assert winograd.accgrad_groups(conv9, 4, 64) == (32, 2)
    assert winograd.accgrad_groups(conv9, 2, 64) == (16, 4)
    big = backends.geometry((64, 64, 224, 224), (64, 64, 3, 3), 1, 1)
    assert winograd.accgrad_groups(big, 2, 64) == (1, 64)
    assert winograd.accgrad_groups(conv9, 4, 1) == (1, 1)
    resnet = backends.geometry((128, 64, 56, 56), (64, 64, 3, 3), 1, 1)
    assert winograd.accgrad_groups(resnet, 4, 128) == (5, 26)
    settings(winograd_workspace_mb=4 * 36 * 512 * 512 * 4 / 2**20)     # a quarter holds one group's sums
    assert winograd.accgrad_groups(conv9, 4, 64) == (64, 1)
    shapes = winograd._shapes(conv9)
    assert shapes == ((64, 512, 28, 28), (512, 512, 3, 3), (1, 1), (1, 1))
    # fprop and bprop at 1 since session 23 (chunks bounded by their operands), accGrad at 3 since
    # session 32 (its chunks and partial sums bounded by its operands), bprop at 2 since session 33
    # (its chunks bounded by once its operands); fprop 2 and bprop 3 since session 57 (the weight
    # transform counted against the floor where the GEMMs stay wide); accGrad 4 since session 58 (its
    # tiles made in row parts)
    assert [winograd.revision(p, *shapes) for p in ("fprop", "bprop", "accgrad")] == [2, 3, 4]
    # TF32 mode: two more (session 22 compared the tiles at the TF32 tolerance; session 31 runs
    # F(2x2) alone there, so auto times winograd's TF32 passes again)
    assert [winograd.revision(p, *shapes, math="tf32") for p in ("fprop", "bprop", "accgrad")] == [4, 5, 6]


def _pass_chunks(x_shape, fo, m, pass_name="fprop"):
    """winograd's batch chunks of a pass for a padded 3x3 layer (fprop's and accGrad's: the same bound)."""
    S, f, h, w = x_shape
    return winograd._conv_chunks(pass_name, S, f, fo, (h, w), (h, w), m)


def test_chunks_hold_at_most_twice_their_operands_in_tiles_bprop_once(settings):
    """OverFeat-fast's conv5 (1024 planes, 12x12, b128) at F(4x4): 340 MB of tiles for 151 MB of
    operands, two chunks of 64 (its converted TF32 step peaked 102 MiB above PyTorch's in session 23
    with one); at F(2x2), 604 MB, two chunks too, in accGrad as well (session 32: its whole-batch
    tiles put the TF32 step ~600 MiB over). Small layers stay whole (ResNet's 14x14 256-plane layer:
    151 MB, under the 256 MB floor; AlexNet's conv4 at 13x13); VGG-16's conv1_2 (b64, 224x224) is
    bounded by the workspace (2048 MiB) as before: two chunks.

    bprop's tiles hold at most once its operands (session 33: the compiled TF32 step peaked in
    conv5's bprop): at F(2x2), the 256 MB floor less the 64 MiB weight transform (session 57),
    so four chunks of 32 images (MIN_CHUNK_FLOP); at F(4x4) two still (counted, its chunks would
    hold too little GEMM work: the floor is the tiles' alone); VGG-16's conv1_2 three."""
    settings(winograd_workspace_mb=2048.0)
    conv5 = (128, 1024, 12, 12)
    assert [(sl.start, sl.stop) for sl in _pass_chunks(conv5, 1024, 4)] == [(0, 64), (64, 128)]
    assert [(sl.start, sl.stop) for sl in _pass_chunks(conv5, 1024, 2)] == [(0, 64), (64, 128)]
    assert _pass_chunks(conv5, 1024, 2, "accgrad") == _pass_chunks(conv5, 1024, 2)
    assert len(_pass_chunks((128, 256, 14, 14), 256, 4)) == 1
    assert len(_pass_chunks((128, 384, 13, 13), 256, 4)) == 1
    assert len(_pass_chunks((64, 64, 224, 224), 64, 4)) == 2
    assert [(sl.start, sl.stop) for sl in _pass_chunks(conv5, 1024, 2, "bprop")] == [(0, 32), (32, 64), (64, 96),
                                                                                    (96, 128)]
    assert [(sl.start, sl.stop) for sl in _pass_chunks(conv5, 1024, 4, "bprop")] == [(0, 64), (64, 128)]
    assert len(_pass_chunks((64, 64, 224, 224), 64, 4, "bprop")) == 3
    assert len(_pass_chunks((128, 256, 14, 14), 256, 4, "bprop")) == 1
    # the workspace still caps it where it is the smaller bound
    settings(winograd_workspace_mb=64.0)
    assert len(_pass_chunks((128, 256, 14, 14), 256, 4)) == 3


def test_the_weight_transform_counts_against_the_floor_where_the_chunks_keep_their_work(settings, monkeypatch):
    """fprop's and bprop's chunks hold the weight transform beside their tiles; it counts against
    TRANSIENT_FLOOR where each chunk's GEMMs keep MIN_CHUNK_FLOP of work (session 57). OverFeat-fast's
    conv5 bprop at F(2x2): 4 chunks of 32 images (38.7 GFLOP a chunk; 3 of 43 with the tiles alone).
    Counted, conv5's F(4x4) bprop would split into chunks of 42-43 images (28.5 GFLOP) and conv4's
    into 64 (21.7), each ~15 % slower in strict fp32 (session 56), and conv4's F(4x4) fprop into 64
    (2 x its operands are under the floor): the floor stays the tiles' alone there. conv5's fprop
    chunks at batch 128 are twice its operands', over the floor either way (at batches 97-111, odd,
    the counted floor is the larger: 3 chunks of ~32); accGrad holds no transform."""
    settings(winograd_workspace_mb=2048.0)
    conv4, conv5 = (128, 512, 12, 12), (128, 1024, 12, 12)
    spans = lambda chunks: [sl.stop - sl.start for sl in chunks]   # noqa: E731
    assert spans(_pass_chunks(conv5, 1024, 2, "bprop")) == [32] * 4
    assert spans(_pass_chunks(conv5, 1024, 4, "bprop")) == [64, 64]
    assert spans(_pass_chunks(conv4, 1024, 4, "bprop")) == [128]
    assert spans(_pass_chunks(conv4, 1024, 4)) == [128]
    assert spans(_pass_chunks(conv5, 1024, 2)) == [64, 64]
    monkeypatch.setattr(winograd, "MIN_CHUNK_FLOP", 0)                 # counted everywhere
    assert spans(_pass_chunks(conv5, 1024, 4, "bprop")) == [43, 43, 42]
    assert spans(_pass_chunks(conv4, 1024, 4, "bprop")) == [64, 64]
    assert spans(_pass_chunks(conv4, 1024, 4)) == [64, 64]
    assert spans(_pass_chunks(conv5, 1024, 2)) == [64, 64]
    assert spans(_pass_chunks(conv5, 1024, 2, "accgrad")) == [64, 64]  # its own bound alone
    monkeypatch.setattr(winograd, "MIN_CHUNK_FLOP", 38.7e9)            # conv5's 38.65 GFLOP chunks too little
    assert spans(_pass_chunks(conv5, 1024, 2, "bprop")) == [43, 43, 42]


def test_accgrad_row_parts_keep_a_chunks_tiles_under_its_operands(settings):
    """accGrad's chunks may hold twice the pass's operands in tiles (the speed of session 33); those
    tiles are made in parts of whole alpha rows of at most once the operands or TRANSIENT_FLOOR
    (session 58). OverFeat-fast's conv5 at F(2x2), b128: a chunk of 64 images holds 288 MiB of
    tiles for 144 MiB of operands, so two parts of two rows, 144 MiB each (the converted TF32 step
    peaked there, 352 MiB with the partial sums). Tiles under the bound: one part; F(4x4)'s alpha of
    6 splits in 2, 3 or 6; past alpha parts, a row each. Each part's GEMM keeps MIN_CHUNK_FLOP of
    work (conv5's 38.7 GFLOP a part; VGG-16's conv4_2 at b64, chunks of 32 images, would have 26:
    0.86x measured, so one part)."""
    MiB, lots = 2**20, 1e15
    floor = winograd.TRANSIENT_FLOOR
    conv5_flop = 2 * 1024 * 1024 * 64 * 36 * 16
    assert winograd._row_parts(4 * 64 * 36 * 16 * 2048, 4 * 128 * 2 * 1024 * 144, 4, conv5_flop) == 2
    vgg_flop = 2 * 512 * 512 * 32 * 196 * 16
    assert winograd._row_parts(4 * 32 * 196 * 16 * 1024, 4 * 64 * 2 * 512 * 784, 4, vgg_flop) == 1
    assert winograd._row_parts(floor, MiB, 4, lots) == 1
    assert winograd._row_parts(floor + 1, MiB, 4, lots) == 2
    assert winograd._row_parts(2 * floor + 1, MiB, 4, lots) == 4
    assert winograd._row_parts(2 * floor + 1, MiB, 6, lots) == 3
    assert winograd._row_parts(3 * floor + 1, MiB, 6, lots) == 6
    assert winograd._row_parts(100 * floor, MiB, 6, lots) == 6
    assert winograd._row_parts(3 * floor, 2 * floor, 4, lots) == 2          # the operands' bound where larger
    work = 3 * winograd.MIN_CHUNK_FLOP
    assert winograd._row_parts(100 * floor, MiB, 6, work) == 3              # as many as keep the work
    assert winograd._row_parts(100 * floor, MiB, 6, work - 1) == 2
    assert winograd._row_parts(100 * floor, MiB, 6, winograd.MIN_CHUNK_FLOP) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", winograd.TILES)
def test_row_parts_of_the_transforms_are_the_whole_ones_rows(device, m, rng):
    """_input_transform and _gradient_transform with rows=(a0, count) give exactly the elements of
    those rows of the whole transform, in the grouped layout (images past the last are zeros)."""
    xp = np if device == "cpu" else pytest.importorskip("cupy")
    alpha = m + 2
    n, f, h, w, groups, per_group = 3, 2, 7, 9, 2, 2
    th, tw = winograd.tiles(h, w, m)
    x = xp.asarray(rng.standard_normal((n, f, h, w)).astype(np.float32))
    layout = (groups, per_group * th * tw)
    host = (lambda a: a) if xp is np else xp.asnumpy
    for transform, args in ((winograd._input_transform, (x, (1, 1), th, tw, m, layout)),
                            (winograd._gradient_transform, (x, th, tw, m, layout))):
        whole = host(transform(xp, *args)).reshape(groups, alpha, alpha, f, -1)
        for count in (c for c in range(1, alpha + 1) if alpha % c == 0):
            for a0 in range(0, alpha, count):
                got = host(transform(xp, *args, rows=(a0, count))).reshape(groups, count, alpha, f, -1)
                np.testing.assert_array_equal(got, whole[:, a0:a0 + count])


# (layout, ROW_FACTOR) -> (row parts at F(2x2), at F(4x4)) for the 5-image layer below
ROW_PART_CASES = {("chunks", 1.0): (2, 2), ("chunks", 0.6): (4, 3), ("chunks", 1e-9): (4, 6),
                  ("one group", 1.0): (2, 2), ("one group", 0.6): (4, 3), ("one chunk", 1.0): (4, 6)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", winograd.TILES)
@pytest.mark.parametrize("layout, row_factor", list(ROW_PART_CASES))
def test_accgrad_in_row_parts_matches_the_reference(device, m, layout, row_factor, settings, monkeypatch, rng):
    """accGrad with its tiles made in row parts, against float64 (the floor and MIN_CHUNK_FLOP at
    zero, ROW_FACTOR times the operands the bound): 2, 3, 4 and 6 parts; in chunks of 2-3 images,
    one image a group (the last chunk with fewer groups than the first); one group a chunk
    (GEMM_BLOCKS 1); one chunk of two groups of 3 images (the second padded with a zero image).
    winograd_tune off: on the GPU its default tunes the images a group among group_options, each
    with its own part count, and the cases are accgrad_groups' picks (session 59, call 1)."""
    alpha = m + 2
    settings(winograd_tune="off")
    monkeypatch.setattr(winograd, "TRANSIENT_FLOOR", 0)
    monkeypatch.setattr(winograd, "MIN_CHUNK_FLOP", 0)
    monkeypatch.setattr(winograd, "ROW_FACTOR", row_factor)
    if layout == "one group":
        monkeypatch.setattr(winograd, "GEMM_BLOCKS", 1)
    if layout == "one chunk":
        monkeypatch.setattr(winograd, "TRANSIENT_FACTOR", {**winograd.TRANSIENT_FACTOR, "accgrad": 100})
        monkeypatch.setattr(winograd, "GEMM_BLOCKS", 2 * alpha * alpha)
    seen, own = [], winograd._row_parts
    monkeypatch.setattr(winograd, "_row_parts", lambda *a: seen.append(own(*a)) or seen[-1])
    groups, own_groups = [], winograd.accgrad_groups
    monkeypatch.setattr(winograd, "accgrad_groups", lambda *a: groups.append(own_groups(*a)) or groups[-1])
    x = rng.standard_normal((5, 4, 10, 12)).astype(np.float32)
    wt = rng.standard_normal((3, 4, 3, 3)).astype(np.float32)
    check_backend(forced(m), x, wt, (1, 1), (1, 1), device=device, tol=TOL, rng=rng)
    assert set(seen) == {ROW_PART_CASES[layout, row_factor][m == 4]}
    per_group = {"chunks": 1, "one group": {2: 2, 4: 3}[m], "one chunk": 3}[layout]
    assert {g[0] for g in groups} == {per_group}


def test_tf32_mode_runs_f2_alone(settings, tmp_path, monkeypatch):
    """On TF32 GEMMs F(4x4) is 2.1e-3 from float64, 7x a direct TF32 convolution (session 31):
    in TF32 mode the tile is F(2x2), untuned, whatever winograd_f4 says; strict fp32 still tunes
    both at TUNE_TOL. The mode is stood in for on the CPU."""
    from minitorch_fft.backends import cgemm, tuning
    tols, tune = [], tuning.tune
    monkeypatch.setattr(tuning, "tune", lambda *a, tol, **k: tols.append(tol) or tune(*a, tol=tol, **k))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 2, 12, 12)).astype(np.float32)
    w = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    settings(winograd_f4=True, winograd_tune="on", tune_cache=str(tmp_path / "cache.json"))
    assert winograd.variants("fp32") == (2, 4) and winograd.variants("tf32") == (2,)
    winograd.fprop(x, w, padding=(1, 1))
    monkeypatch.setattr(cgemm, "mode", lambda xp: "tf32")
    y = winograd.fprop(x, w, padding=(1, 1))
    assert tols == [winograd.TUNE_TOL]                  # the TF32 call tuned nothing
    np.testing.assert_array_equal(y, winograd.fprop(x, w, padding=(1, 1), tile=2))
    import json
    keys = [json.loads(k) for k in json.loads((tmp_path / "cache.json").read_text())["devices"]["cpu"]]
    assert [(k[1], k[4]) for k in keys] == [("fp32", "winograd_r2")]


def test_group_options_span_the_accuracy_rule_to_many_groups(settings):
    """From the accuracy rule's groups (GROUP_TILES; the workspace's cap) to 16 times as many, and
    accgrad_groups' own pick, largest groups first."""
    settings(winograd_workspace_mb=2048.0)
    conv9 = backends.geometry((64, 512, 28, 28), (512, 512, 3, 3), 1, 1)
    assert winograd.group_options(conv9, 4, 64) == (64, 32, 16, 13)     # 13: 5 groups' sums, its 205 MB of operands
    resnet = backends.geometry((128, 64, 56, 56), (64, 64, 3, 3), 1, 1)
    assert winograd.group_options(resnet, 4, 128) == (20, 10, 5, 3, 2)
    assert winograd.group_options(conv9, 4, 1) == (1,)


def test_accgrad_partial_sums_stay_under_the_operands(settings):
    """OverFeat-fast's conv5 at F(2x2), TF32 mode's only tile (b128, 151 MB of x and gy): session 31
    tuned 8 groups, 512 MiB of partial sums; now one or two (64 MiB each) a chunk. ResNet's 512
    planes at 7x7 (26 MB of operands) keep the four groups that fill the GPU (GROUP_FLOOR)."""
    settings(winograd_workspace_mb=2048.0)
    conv5 = backends.geometry((128, 1024, 12, 12), (1024, 1024, 3, 3), 1, 1)
    assert winograd._group_cap(conv5) == 4 * 128 * 2 * 1024 * 144
    assert winograd.group_options(conv5, 2, 64) == (64, 32)
    assert winograd.accgrad_groups(conv5, 2, 64) == (64, 1)         # 1024 blocks in one group
    layer4 = backends.geometry((128, 512, 7, 7), (512, 512, 3, 3), 1, 1)
    assert winograd._group_cap(layer4) == winograd.GROUP_FLOOR
    assert winograd.accgrad_groups(layer4, 2, 128) == (32, 4)


def test_the_group_count_is_tuned_and_remembered(settings, tmp_path, rng):
    """With winograd_tune on (here on the CPU), accGrad times group_options, remembers the choice
    per geometry, tile and chunk, and the result still matches float64; the nested tile tuning too."""
    import json
    from reference import conv_reference, rel_error
    settings(winograd_tune="on", tune_cache=str(tmp_path / "cache.json"), winograd_workspace_mb=2048.0)
    x = rng.standard_normal((6, 3, 10, 10)).astype(np.float32)
    gy = rng.standard_normal((6, 4, 10, 10)).astype(np.float32)
    want = conv_reference(x, np.zeros((4, 3, 3, 3), np.float32), gy, (1, 1), (1, 1))[2]
    for tile in (4, None):
        assert rel_error(winograd.accgrad(gy, x, (4, 3, 3, 3), padding=(1, 1), tile=tile), want) <= TOL
    records = json.loads((tmp_path / "cache.json").read_text())["devices"]["cpu"]
    groups = {json.loads(k)[4]: v for k, v in records.items() if "winograd_groups" in k}
    g = backends.geometry(x.shape, (4, 3, 3, 3), 1, 1)
    ws = f"{backends.config.get('winograd_workspace_mb'):g}"
    assert set(groups) == {f"winograd_groups_r4_f2_n6_ws{ws}", f"winograd_groups_r4_f4_n6_ws{ws}"}
    for name, record in groups.items():
        tile = int(name.split("_f")[1].split("_")[0])
        assert record["choice"] in winograd.group_options(g, tile, 6)


def test_toom_cook_matrices_compute_the_correlation_exactly():
    """y = AT [(G g) * (BT d)] equals y_i = sum_k d_(i+k) g_k in exact rational arithmetic."""
    rng = np.random.default_rng(7)
    for m in winograd.TILES:
        AT, G, BT = winograd.toom_cook(m)
        for _ in range(5):
            d = [Fraction(int(v)) for v in rng.integers(-9, 10, m + 2)]
            g = [Fraction(int(v)) for v in rng.integers(-9, 10, 3)]
            u = [sum(G[a][k] * g[k] for k in range(3)) for a in range(m + 2)]
            v = [sum(BT[a][k] * d[k] for k in range(m + 2)) for a in range(m + 2)]
            y = [sum(AT[i][a] * u[a] * v[a] for a in range(m + 2)) for i in range(m)]
            assert y == [sum(d[i + k] * g[k] for k in range(3)) for i in range(m)]


def test_the_cuda_literals_are_toom_cooks_matrices():
    """kernels/winograd.cu spells AT, G and BT of each F3<M> out; they must be toom_cook()'s."""
    src = (KERNEL_DIR / "winograd.cu").read_text()
    for m in winograd.TILES:
        block = re.search(rf"struct F3<{m}> \{{(.*?)\n\}};", src, re.S).group(1)
        for name, want in zip(("AT", "G", "BT"), winograd.toom_cook(m)):
            body = re.search(rf"static (?:float|double) {name}\(.*?= \{{(.*?)\}};", block, re.S).group(1)
            numbers = [Fraction(a) / Fraction(b or "1") for a, b in
                       re.findall(r"(-?\d+)\.f?(?:\s*/\s*(\d+)\.f?)?", body)]
            assert numbers == [v for row in want for v in row], f"F3<{m}>::{name}"


def test_supports_is_3x3_stride_1():
    assert winograd.supports((1, 1, 13, 13), (1, 1, 3, 3), (1, 1), (1, 1))
    assert winograd.supports((2, 3, 1, 1), (4, 3, 3, 3), (1, 1), (1, 1))
    assert not winograd.supports((1, 1, 13, 13), (1, 1, 3, 3), (2, 2), (1, 1))
    assert not winograd.supports((1, 1, 13, 13), (1, 1, 5, 5), (1, 1), (2, 2))
    assert not winograd.supports((1, 1, 13, 13), (1, 1, 3, 1), (1, 1), (1, 0))
    assert not winograd.supports((1, 1, 2, 2), (1, 1, 3, 3), (1, 1), (0, 0))     # kernel > input
    assert "winograd" in backends.names()


def test_bad_input_is_refused_before_any_work(rng):
    x = rng.standard_normal((1, 2, 8, 8)).astype(np.float32)
    w3 = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    with pytest.raises(ValueError, match="3x3 kernels at stride 1 only, got 5x5"):
        winograd.fprop(x, rng.standard_normal((3, 2, 5, 5)).astype(np.float32))
    with pytest.raises(ValueError, match=r"stride \(2, 2\)"):
        winograd.fprop(x, w3, stride=(2, 2))
    with pytest.raises(ValueError, match=r"tile must be one of \(2, 4\), got 3"):
        winograd.fprop(x, w3, tile=3)
    with pytest.raises(TypeError, match="must be float32"):
        winograd.fprop(x.astype(np.float64), w3)
    with pytest.raises(ValueError, match="channel mismatch"):
        winograd.fprop(x, rng.standard_normal((3, 4, 3, 3)).astype(np.float32))
    with pytest.raises(ValueError, match=r"gy must have shape \(1, 3, 8, 8\)"):
        winograd.bprop(np.ones((1, 3, 7, 8), np.float32), w3, x.shape, padding=(1, 1))
    with pytest.raises(ValueError, match="does not support"):
        backends.choose("winograd", "fprop", (1, 2, 8, 8), (3, 2, 5, 5))


def test_f4_is_a_setting(settings):
    assert winograd.variants() == (2, 4)          # the default: both eligible
    settings(winograd_f4=False)
    assert winograd.variants() == (2,)
    settings(winograd_f4=True)
    assert winograd.variants() == (2, 4)
    assert winograd.variants("tf32") == (2,)      # F(2x2) alone on TF32 GEMMs


def test_tuned_tile_on_the_cpu_and_on_nan_data(settings, tmp_path, rng):
    """winograd_tune=on: the tile is tuned by tuning.remembered (cached); data holding NaN cannot
    check the candidates, so that call runs untuned (F(2x2)) and caches nothing."""
    cache = tmp_path / "cache.json"
    settings(winograd_f4=True, winograd_tune="on", tune_cache=str(cache))
    x = rng.standard_normal((1, 2, 9, 9)).astype(np.float32)
    wt = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    x[0, 0, 4, 4] = np.nan
    assert np.isnan(winograd.fprop(x, wt, padding=(1, 1))).any()
    assert not cache.exists()
    x[0, 0, 4, 4] = 0.5
    check_backend(winograd, x, wt, (1, 1), (1, 1), tol=TOL, rng=rng)
    assert cache.exists() and "winograd" in cache.read_text()


def test_tiles_cover_the_output():
    assert winograd.tiles(224, 224, 4) == (56, 56)
    assert winograd.tiles(7, 13, 4) == (2, 4)
    assert winograd.tiles(1, 1, 2) == (1, 1)


# -- GPU: the CUDA kernels ------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_the_output_transform_writes_into_a_batch_slice(device, rng):
    """_conv's chunks write their outputs into the pass's result (session 56: no chunk-sized
    result, no copy): into a batch slice, the values a new array gets, the rest untouched; an out
    of the wrong shape, dtype or layout is refused before the kernel runs."""
    xp = np if device == "cpu" else pytest.importorskip("cupy")
    m, n, fo, oh, ow = 2, 3, 4, 5, 7
    th, tw = winograd.tiles(oh, ow, m)
    prod = xp.asarray(rng.standard_normal(((m + 2) ** 2, fo, n * th * tw)).astype(np.float32))
    y = xp.full((n + 2, fo, oh, ow), -1.0, dtype=np.float32)
    host = (lambda a: a) if xp is np else xp.asnumpy
    out = y[1:1 + n]
    assert winograd._output_transform(xp, prod, n, oh, ow, m, out=out) is out
    np.testing.assert_array_equal(host(y[1:1 + n]), host(winograd._output_transform(xp, prod, n, oh, ow, m)))
    assert (host(y[0]) == -1).all() and (host(y[-1]) == -1).all()
    wrong_layout = xp.empty((n, fo, ow, oh), dtype=np.float32).transpose(0, 1, 3, 2)
    for bad in (y[:n + 1], y[1:1 + n].astype(np.float64), wrong_layout):
        with pytest.raises(ValueError, match="C-contiguous float32 of shape"):
            winograd._output_transform(xp, prod, n, oh, ow, m, out=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("m", winograd.TILES)
def test_cuda_outputs_every_element_against_float64(m, fresh_rng):
    """Network-sized and odd layers, every CuPy allocation NaN-filled first (harness.poisoned):
    an element the kernels forget to write fails the check."""
    from benchmarks.harness import poisoned
    for S, f, fo, h, w, pad in [(8, 64, 64, 56, 56, (1, 1)), (16, 256, 128, 14, 14, (1, 1)),
                                (4, 32, 48, 7, 7, (1, 1)), (3, 5, 7, 29, 31, (2, 0)), (2, 3, 4, 6, 5, (3, 4))]:
        x = fresh_rng.standard_normal((S, f, h, w)).astype(np.float32)
        wt = (fresh_rng.standard_normal((fo, f, 3, 3)) / np.sqrt(9 * f)).astype(np.float32)
        poisoned(lambda: check_backend(forced(m), x, wt, (1, 1), pad, device="cuda", tol=TOL, rng=fresh_rng))


@pytest.mark.gpu
def test_cuda_random_geometries_against_float64(fresh_rng):
    for _ in range(30):
        S, f, fo = (int(v) for v in fresh_rng.integers(1, 9, 3))
        ph, pw = (int(v) for v in fresh_rng.integers(0, 4, 2))
        h, w = (int(v) for v in fresh_rng.integers(max(1, 3 - 2 * min(ph, pw)), 40, 2))
        x = fresh_rng.standard_normal((S, f, h, w)).astype(np.float32)
        wt = fresh_rng.standard_normal((fo, f, 3, 3)).astype(np.float32)
        for m in winograd.TILES:
            check_backend(forced(m), x, wt, (1, 1), (ph, pw), device="cuda", tol=TOL, rng=fresh_rng)


@pytest.mark.gpu
def test_cuda_tf32_mode_stays_near_a_direct_tf32_convolution(settings, tmp_path, fresh_rng):
    """In TF32 mode (F(2x2) alone) each pass of OverFeat-fast's 1024-plane layer stays within 1e-3
    of float64: F(4x4) gave 2.1e-3 there, 7x a direct TF32 convolution's 2.9e-4 (session 31)."""
    from minitorch_fft.backends import cgemm
    settings(winograd_f4=True, winograd_tune="on", tune_cache=str(tmp_path / "cache.json"))
    x = fresh_rng.standard_normal((8, 1024, 12, 12)).astype(np.float32)
    wt = (fresh_rng.standard_normal((1024, 1024, 3, 3)) / 96).astype(np.float32)
    with cgemm.tf32(True):
        errs = check_backend(winograd, x, wt, (1, 1), (1, 1), device="cuda", tol=1e-3, rng=fresh_rng)
    assert min(errs.values()) > 1e-5, f"not on TF32 GEMMs: {errs}"   # the mode really was on


@pytest.mark.gpu
def test_cuda_tuned_tile_is_one_of_the_variants(settings, tmp_path, rng):
    """With F(4x4) allowed, the tile is tuned per pass (tuning.remembered) and still correct."""
    settings(winograd_f4=True, winograd_tune="on", tune_cache=str(tmp_path / "cache.json"))
    x = rng.standard_normal((8, 32, 28, 28)).astype(np.float32)
    wt = (rng.standard_normal((32, 32, 3, 3)) / 17).astype(np.float32)
    check_backend(winograd, x, wt, (1, 1), (1, 1), device="cuda", tol=TOL, rng=rng)
    assert (tmp_path / "cache.json").exists()


def test_a_float_tile_is_refused_forced_or_cached(settings, tmp_path):
    """4.0 == 4, so a float tile passed the check and then failed deep in the pass (TypeError): forced,
    a ValueError naming it; in the cache (a JSON tool may write 4 as 4.0), ignored with a warning and
    tuned again."""
    import json
    from minitorch_fft.backends import tuning
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, 10, 10)).astype(np.float32)
    w = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    with pytest.raises(ValueError, match=r"winograd tile must be one of \(2, 4\), got 4.0"):
        winograd.fprop(x, w, padding=(1, 1), tile=4.0)
    cache = tmp_path / "cache.json"
    settings(winograd_f4=True, winograd_tune="on", tune_cache=str(cache))
    y = winograd.fprop(x, w, padding=(1, 1))
    data = json.loads(cache.read_text())
    (record,) = data["devices"]["cpu"].values()
    record["choice"] = float(record["choice"])
    cache.write_text(json.dumps(data))
    tuning._caches.clear()
    tuning._memo.clear()
    with pytest.warns(UserWarning, match="ignoring invalid cached tuning record"):
        again = winograd.fprop(x, w, padding=(1, 1))
    np.testing.assert_allclose(again, y, rtol=1e-4, atol=1e-5)


# -- the prepared fprop and bprop (winograd.prepare) on the CPU -------------------------------------

@pytest.mark.parametrize("xs,ws,padding", [((3, 5, 9, 7), (6, 5, 3, 3), (1, 0)), ((2, 4, 6, 5), (3, 4, 3, 3), (0, 3)),
                                           ((1, 8, 12, 12), (16, 8, 3, 3), (1, 1)), ((4, 3, 5, 8), (2, 3, 3, 3), (2, 1))])
@pytest.mark.parametrize("m", winograd.TILES)
@pytest.mark.parametrize("pass_name", ["fprop", "bprop"])
def test_prepared_call_launches_what_the_full_path_launches(pass_name, m, xs, ws, padding, monkeypatch):
    """winograd.prepare's run makes the kernel launches and the GEMM of the full path (fprop or bprop
    through _conv, one chunk), argument for argument: asymmetric padding, planes and planes swapped in
    bprop, its 2 - p padding (negative where p > 2)."""
    from recorder import Recorder            # its kernel launches and GEMMs recorded; installed for winograd alone
    fake = Recorder()
    monkeypatch.setattr(winograd, "cuda_module", lambda *a, **k: fake)
    monkeypatch.setattr(winograd.cgemm, "matmul", fake.matmul)        # the full path's GEMM
    monkeypatch.setattr(winograd.cgemm, "prepare", fake.prepare_gemm)  # the prepared one's
    monkeypatch.setattr(winograd, "check_arrays", lambda **arrays: (fake, *arrays.values()))
    monkeypatch.setattr(winograd, "_chosen_tile", lambda xp, pn, g: m)
    g = winograd.check_geometry(xs, ws, (1, 1), padding)
    x, w = np.zeros(xs, np.float32), np.zeros(ws, np.float32)
    gy = np.zeros((g.S, g.fo, g.oh, g.ow), np.float32)
    if pass_name == "fprop":
        full = winograd.fprop(x, w, (1, 1), padding, tile=m)
    else:
        full = winograd.bprop(gy, w, xs, (1, 1), padding, tile=m)
    launched, fake.calls = fake.calls, []
    run = winograd.prepare(pass_name, g, fake)
    assert run is not None
    prepared = run(x if pass_name == "fprop" else gy, w)
    assert fake.calls == launched and len(launched) == 4
    assert prepared.shape == full.shape and prepared.dtype == full.dtype == np.float32


def test_prepared_tile_is_the_tuned_one(settings, tmp_path):
    """_chosen_tile (what prepare runs) answers the tile _tile would take: none before the pass is
    tuned, the tuned one after (tuned here on the CPU, winograd_tune on), the only one in TF32 mode
    or where F(4x4) is off, F(2x2) with tuning off."""
    settings(tune_cache=str(tmp_path / "t.json"), winograd_tune="on", winograd_f4=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 10, 9)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    g = winograd.check_geometry(x.shape, w.shape, (1, 1), (1, 1))
    assert winograd._chosen_tile(np, "fprop", g) is None
    winograd.fprop(x, w, (1, 1), (1, 1))                       # tunes the tile
    record = backends.tuning.peek(winograd._tile_key(np, "fprop", g))
    assert record is not None and winograd._chosen_tile(np, "fprop", g) == record["choice"] in winograd.TILES
    assert winograd._chosen_tile(np, "bprop", g) is None       # another pass, not tuned
    with backends.config.override(winograd_f4=False):
        assert winograd._chosen_tile(np, "bprop", g) == 2
    with backends.config.override(winograd_tune="off"):
        assert winograd._chosen_tile(np, "bprop", g) == 2

"""Data-parallel training (minitorch_fft.distributed): sharding, the flat gradient buffer, the
launcher's checks, the rendezvous and fault channel between processes (CPU, loopback only), and
a real NCCL communicator with one rank (gpu)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import minitorch_fft as mt
from minitorch_fft import models
from minitorch_fft import distributed
from minitorch_fft.cli import main, parse_args

ROOT = Path(__file__).resolve().parent.parent


# -- sharding ---------------------------------------------------------------------------------

def _index_dataset(n):
    """A data set whose image i is the number i: a batch says which images it holds."""
    return mt.data.ArrayDataset(np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1), np.zeros(n))


def _seen(n, batch, rank, world, epoch=0, start=0, seed=3):
    return [x.reshape(-1).astype(int).tolist() for x, _ in
            mt.data.batches(_index_dataset(n), batch, seed=seed, epoch=epoch, start=start, rank=rank,
                            world_size=world)]


@pytest.mark.parametrize("n, batch, world", [(100, 4, 2), (101, 3, 4), (64, 8, 8), (10, 5, 2)])
def test_shards_are_disjoint_cover_the_global_batches_and_follow_one_process_order(n, batch, world):
    shards = [_seen(n, batch, r, world) for r in range(world)]
    steps = n // (batch * world)
    assert all(len(s) == steps and all(len(b) == batch for b in s) for s in shards)
    flat = [i for s in shards for b in s for i in b]
    assert len(set(flat)) == len(flat) == steps * batch * world          # disjoint
    # step b of all ranks together is one process's batch b of batch * world images, in rank order
    one = _seen(n, batch * world, 0, 1)
    for b in range(steps):
        assert sum((shards[r][b] for r in range(world)), []) == one[b]
    assert shards == [_seen(n, batch, r, world) for r in range(world)]   # deterministic
    assert _seen(n, batch, 1, world, epoch=1) != shards[1]                 # a new order each epoch


def test_a_resumed_epoch_sees_the_same_shards_and_one_rank_is_plain_batching():
    full = _seen(200, 6, 2, 4, epoch=2)
    assert _seen(200, 6, 2, 4, epoch=2, start=3) == full[3:]
    plain = [x.reshape(-1).astype(int).tolist() for x, _ in mt.data.batches(_index_dataset(23), 5, seed=3)]
    assert _seen(23, 5, 0, 1) == plain and len(plain[-1]) == 3   # the partial last batch stays
    with pytest.raises(ValueError, match="rank must be an int in 0 .. world_size-1"):
        _seen(10, 2, 2, 2)


# -- the flat gradient buffer -------------------------------------------------------------------

class _DoublingComm(distributed.FakeCommunicator):
    """Two ranks that hold the same gradients: the sum is twice the array."""

    def __init__(self):
        super().__init__(0, 1)
        self.calls = []

    def all_reduce(self, array, stream=None, average=False):
        self.calls.append((array.size, average))
        array *= 2
        if average:
            array *= 0.5


def _digits_model(seed=0):
    mt.manual_seed(seed)
    return models.get("digits", num_classes=10, backend="gemm")


def _gradients(model, x, y):
    model.zero_grad()
    mt.CrossEntropyCriterion()(model(mt.Tensor(x)), y).backward()
    return [p.grad.copy() for p in model.parameters()]


def test_grads_are_views_of_the_flat_buffer_and_its_all_reduce_updates_every_grad():
    train, _ = mt.data.digits()
    x, y = train.take(np.arange(16))
    reference = _gradients(_digits_model(), x, y)        # plain autograd, no sync
    model = _digits_model()
    comm = _DoublingComm()
    group = distributed.ProcessGroup(0, 2, comm)            # sum of two equal ranks, scaled by 1/2
    sync = distributed.GradientSync(model.parameters(), group, bucket_mb=0.004)   # ~1k floats a bucket
    (flat,) = sync.flat.values()
    assert flat.size == sum(p.data.size for p in model.parameters()) and len(sync.buckets) > 2
    sync.begin()
    model.zero_grad()
    mt.CrossEntropyCriterion()(model(mt.Tensor(x)), y).backward()
    assert len(comm.calls) == len(sync.buckets)             # each bucket launched during backward
    sync.finish()
    assert sum(n for n, _ in comm.calls) == flat.size
    assert all(average for _, average in comm.calls)        # the mean, in the all-reduce itself
    for p, ref in zip(model.parameters(), reference):
        assert p.grad is sync.view(p) and np.shares_memory(p.grad, flat)
        np.testing.assert_allclose(p.grad, ref, rtol=1e-6, atol=1e-7)   # (g + g) / 2
    flat[...] = 7.0                                          # the buffer is the gradients
    assert all(np.all(p.grad == 7.0) for p in model.parameters())
    sync.remove()
    assert all(p.grad_hook is None for p in model.parameters())


class _Probe(mt.tensor.Function):
    """The identity, noting when backward passes through it."""
    def forward(self, x, events, name):
        self.events, self.name = events, name
        return x

    def backward(self, g):
        self.events.append(self.name)
        return g


def test_a_layers_gradients_are_handed_over_before_the_layers_below_run_backward():
    """The buckets can start during backward only if a layer's weight and bias gradients reach
    their hooks as soon as that layer's backward has run, not once the whole network's has (as
    before: on two H200s every AlexNet all-reduce started after backward's last kernel)."""
    mt.manual_seed(0)
    conv1 = mt.SpatialConvolution(1, 4, 3, padding=1, backend="gemm")
    conv2 = mt.SpatialConvolution(4, 4, 3, padding=1, backend="gemm")
    fc = mt.Linear(4 * 8 * 8, 10)
    events = []
    for layer, name in ((conv1, "conv1"), (conv2, "conv2"), (fc, "fc")):
        for pname, p in layer.named_parameters():
            p.grad_hook = lambda p, g, n=f"{name}.{pname}": events.append(n)
    x = mt.Tensor(np.random.default_rng(0).standard_normal((2, 1, 8, 8)).astype(np.float32))
    h = _Probe.apply(conv1(x), events=events, name="backward reaches conv1's output")
    h = _Probe.apply(conv2(h), events=events, name="backward reaches conv2's output")
    mt.CrossEntropyCriterion()(fc(mt.View(4 * 8 * 8)(h)), np.array([1, 2])).backward()
    assert events == ["fc.bias", "fc.weight", "backward reaches conv2's output", "conv2.bias", "conv2.weight",
                      "backward reaches conv1's output", "conv1.bias", "conv1.weight"]


def test_a_parameter_backward_does_not_reach_keeps_no_gradient():
    a, b = mt.Parameter(np.ones(3)), mt.Parameter(np.ones(2))
    sync = distributed.GradientSync([a, b], distributed.ProcessGroup(0, 1, distributed.FakeCommunicator()))
    sync.begin()
    (a * mt.Tensor(np.array([1.0, 2.0, 3.0]))).sum().backward()
    sync.finish()
    assert b.grad is None and a.grad.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(RuntimeError, match="without begin"):
        sync.finish()


def test_a_parameter_this_rank_does_not_reach_takes_the_others_gradient():
    # Rank 0 of two never reaches b; the other rank does (the doubling communicator stands for
    # it, adding what it holds): b.grad must be the all-reduced view, or the replicas diverge.
    a, b = mt.Parameter(np.ones(3)), mt.Parameter(np.ones(2))
    sync = distributed.GradientSync([a, b], distributed.ProcessGroup(0, 2, _DoublingComm()))
    sync.begin()
    (a * mt.Tensor(np.array([1.0, 2.0, 3.0]))).sum().backward()
    sync.finish()
    assert b.grad is sync.view(b) and b.grad.tolist() == [0.0, 0.0]
    assert a.grad.tolist() == [1.0, 2.0, 3.0]


def test_one_rank_with_the_fake_communicator_trains_exactly_as_one_process():
    train, _ = mt.data.digits()
    results = []
    for data_parallel in (False, True):
        model = _digits_model(seed=5)
        opt = mt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        sync = None
        if data_parallel:
            group = distributed.ProcessGroup(0, 1, distributed.FakeCommunicator())
            group.broadcast_arrays(distributed.model_state_arrays(model))
            sync = distributed.GradientSync(model.parameters(), group, bucket_mb=0.01)
        for epoch in range(2):
            for x, y in mt.data.batches(train, 100, seed=5, epoch=epoch, rank=0, world_size=1):
                mt.train_step(model, mt.CrossEntropyCriterion(), opt, mt.Tensor(x), y, sync=sync)
        results.append([p.data.copy() for p in model.parameters()])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


# -- the launcher's checks -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(gpus=3, visible=2), "--gpus 3: only 2 GPUs visible"),
    (dict(gpus=1, visible=0), "--gpus 1: only 0 GPUs visible"),
    (dict(gpus=2, visible=8, nccl=0), "--gpus needs NCCL"),
    (dict(gpus=4, batch_size=64, n_train=200), "--batch-size 64 is per GPU: 4 GPUs take 256 images a step"),
    (dict(gpus=2, device="cpu"), "--device cpu cannot go with it"),
    (dict(gpus=0), "--gpus takes an integer >= 1"),
])
def test_bad_configurations_are_refused_naming_the_limit(kwargs, message):
    args = dict(gpus=2, batch_size=32, n_train=1000, device="auto", visible=8, nccl=23007) | kwargs
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        distributed.check_launch(**args)
    distributed.check_launch(**(args | dict(gpus=1, batch_size=1, device="cuda", visible=1, nccl=1,
                                            n_train=1)))   # the limits themselves pass


def test_train_py_refuses_more_gpus_than_visible_before_starting_a_process(monkeypatch, capsys):
    monkeypatch.setattr(distributed, "visible_gpus", lambda: 1)
    monkeypatch.setattr(distributed.subprocess, "Popen", lambda *a, **k: pytest.fail("a process started"))
    assert main(["--gpus", "2", "--epochs", "1", "--no-progress"]) == 2
    assert "--gpus 2: only 1 GPU visible" in capsys.readouterr().err


def test_the_launcher_environment_is_read_and_checked(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert distributed.launched() is None and distributed.is_rank0()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="RANK=4: a rank 0 .. WORLD_SIZE-1 = 3"):
        distributed.launched()
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="needs MASTER_ADDR and MASTER_PORT"):
        distributed.launched()
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert distributed.launched() == distributed.Launch(2, 4, 2, "10.0.0.1", 29500)  # LOCAL_RANK: RANK
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert distributed.launched().local_rank == 0 and not distributed.is_rank0()
    monkeypatch.setenv("MASTER_PORT", "70000")
    with pytest.raises(ValueError, match="MASTER_PORT"):
        distributed.launched()


def test_a_rank_refuses_a_gpus_flag_that_is_not_its_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    args = parse_args(["--gpus", "2"])
    with pytest.raises(ValueError, match="--gpus 2 but the launcher started WORLD_SIZE=1"):
        distributed.join(args)


# -- processes: the rendezvous, failures and signals (CPU, 127.0.0.1 only) -------------------------

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from minitorch_fft import distributed
    mode, folder = sys.argv[1], sys.argv[2]
    launch = distributed.launched()
    group = distributed.init_process_group(launch, "fake", timeout=20)
    signal.signal(signal.SIGTERM, group.on_signal)          # as train.py does in a rank
    with open(os.path.join(folder, f"rank{launch.rank}"), "w") as f:
        f.write(f"{os.getpid()} {group.uid.hex()}")
    with group.failing_together():
        if mode == "fail" and launch.rank == 1:
            time.sleep(0.5)
            raise RuntimeError("planted failure")
        if mode == "cause" and launch.rank == 1:      # as train.py's exit 5 after an out-of-memory step
            time.sleep(0.5)
            group.channel.fail("MemoryError: planted")   # what failing_together does on the way out
            time.sleep(1.0)                               # slower to end than the peer it told
            os._exit(5)
        if mode in ("fail", "wait", "cause"):
            time.sleep(60)
""")


def _launch(tmp_path, mode):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    launcher = ("import sys; from minitorch_fft import distributed; "
                f"sys.exit(distributed.spawn(2, [sys.executable, {str(script)!r}, {mode!r}, {str(tmp_path)!r}]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", launcher], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)


def _wait_for_ranks(tmp_path, n=2, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [tmp_path / f"rank{r}" for r in range(n)]
        if all(f.exists() and f.read_text() for f in files):
            return [f.read_text().split() for f in files]
        time.sleep(0.05)
    pytest.fail("the ranks did not meet in time")


def test_rank_0_hands_its_id_to_the_other_rank_and_both_end_cleanly(tmp_path):
    proc = _launch(tmp_path, "ok")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    (pid0, uid0), (pid1, uid1) = _wait_for_ranks(tmp_path)
    assert uid0 == uid1 and len(bytes.fromhex(uid0)) == 128 and pid0 != pid1


def test_an_exception_in_one_rank_brings_the_other_down_with_its_reason(tmp_path):
    t0 = time.monotonic()
    proc = _launch(tmp_path, "fail")
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30                    # not the 60 s the other rank sleeps
    assert proc.returncode != 0
    assert "rank 0: stopping because rank 1: RuntimeError: planted failure" in err, err


def test_the_launcher_exits_with_the_failing_ranks_code_not_its_peers(tmp_path):
    """The failing rank tells its peers first, so their EXIT_PEER_FAILED (4) comes before its own code;
    spawn waits for the cause (here 5, train.py's out of memory) and returns it."""
    proc = _launch(tmp_path, "cause")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 5, err
    assert "rank 1 exited with status 5" in err, err


def test_sigterm_to_one_rank_stops_every_rank_within_seconds(tmp_path):
    proc = _launch(tmp_path, "wait")
    (pid0, _), (pid1, _) = _wait_for_ranks(tmp_path)
    t0 = time.monotonic()
    os.kill(int(pid1), signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 15
    assert proc.returncode != 0
    assert "stopping because rank 1: stopped by SIGTERM" in err, err


def test_a_rank_that_dies_without_a_word_is_noticed(tmp_path):
    proc = _launch(tmp_path, "wait")
    (pid0, _), (pid1, _) = _wait_for_ranks(tmp_path)
    t0 = time.monotonic()
    os.kill(int(pid1), signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 15 and proc.returncode != 0
    assert "rank 1 ended without a word" in err or "rank 1 exited with status -9" in err, err


# -- one GPU: a real NCCL communicator with one rank ---------------------------------------------

def _nccl_group():
    if not distributed.nccl_version():
        pytest.skip("CuPy has no NCCL here")
    return distributed.init_process_group(distributed.Launch(0, 1, 0, "127.0.0.1", 0), "nccl", timeout=30)


@pytest.fixture(scope="module")
def nccl_group():
    return _nccl_group()


@pytest.mark.gpu
def test_nccl_all_reduce_broadcast_and_barrier_with_one_rank(nccl_group, rng):
    import cupy as cp
    a = rng.standard_normal(1000).astype(np.float32)
    d = cp.asarray(a)
    nccl_group.comm.all_reduce(d)
    np.testing.assert_array_equal(cp.asnumpy(d), a)          # the sum over one rank
    nccl_group.comm.all_reduce(d, average=True)
    np.testing.assert_array_equal(cp.asnumpy(d), a)          # and the mean (ncclAvg)
    d64 = cp.asarray(a.astype(np.float64))
    nccl_group.comm.broadcast(d64)
    np.testing.assert_array_equal(cp.asnumpy(d64), a.astype(np.float64))
    nccl_group.barrier()
    assert nccl_group.sum_host([1.5, 2]).tolist() == [1.5, 2.0]


def _gpu_model(seed=0):
    mt.manual_seed(seed)
    return models.get("digits", num_classes=10, backend="gemm").to("cuda")


class _TwoRankMean:
    """The one-rank NCCL communicator standing in for two ranks that hold the same gradients:
    the mean is NCCL's sum (over the one real rank) halved on the same stream. (NCCL's own mean,
    ncclAvg, divides by the real ranks' count, 1: it would hide whether the all-reduce ran.)"""

    def __init__(self, comm):
        self.comm = comm

    def all_reduce(self, array, stream=None, average=False):
        import cupy as cp
        self.comm.all_reduce(array, stream)
        if average:
            with stream or cp.cuda.get_current_stream():
                array *= array.dtype.type(0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("halved", [False, True])
def test_a_step_with_nccl_one_rank_equals_the_single_gpu_step(nccl_group, graphed, halved):
    """One rank: the averaged gradient is the gradient, and the steps agree. `halved`: the NCCL
    communicator as the mean of two ranks that hold the same gradients (_TwoRankMean), so the
    gradients are all-reduced and scaled by 1/2 in every step, replays included: SGD without
    weight decay on g/2 is SGD on g at half the learning rate (a power of two: the same rounding)."""
    import cupy as cp
    train, _ = mt.data.digits()
    group = distributed.ProcessGroup(0, 2, _TwoRankMean(nccl_group.comm)) if halved else nccl_group
    wd = 0.0 if halved else 5e-4
    params = []
    for sync_on in (False, True):
        model = _gpu_model(seed=2)
        lr = 0.05 if sync_on or not halved else 0.025
        opt = mt.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=wd)
        sync = distributed.GradientSync(model.parameters(), group, bucket_mb=0.01) if sync_on else None
        step = mt.graphs.GraphedStep(model, mt.CrossEntropyCriterion(), opt, sync=sync) if graphed else None
        for x, y in list(mt.data.batches(train, 64, seed=2))[:4]:
            if step is not None:
                step(cp.asarray(x), y)
            else:
                mt.train_step(model, mt.CrossEntropyCriterion(), opt, mt.Tensor(cp.asarray(x)), cp.asarray(y),
                              sync=sync)
        if step is not None:
            assert step.captures == 1 and step.calls == 4            # three replays with the all-reduce
        if sync is not None:
            assert len(sync.buckets) > 1
            sync.remove()
        params.append([cp.asnumpy(p.data) for p in model.parameters()])
    for a, b in zip(*params):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _train_py(*flags, timeout=200):
    res = subprocess.run([sys.executable, "train.py", "--backend", "gemm", "--no-progress", "--device", "cuda",
                          *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


@pytest.mark.gpu
def test_train_py_gpus_1_equals_one_process_and_resumes_exactly(tmp_path):
    plain, _ = _train_py("--epochs", "2")
    ddp, err = _train_py("--epochs", "2", "--gpus", "1")
    assert "1 GPU, batch 32 per GPU (32 a step)" in err
    assert [h["loss"] for h in ddp["history"]] == [h["loss"] for h in plain["history"]]
    assert ddp["test_accuracy"] == plain["test_accuracy"]
    ckpt = str(tmp_path / "run.ckpt")
    _train_py("--epochs", "2", "--gpus", "1", "--checkpoint", ckpt, "--max-epochs-this-run", "1")
    resumed, _ = _train_py("--checkpoint", ckpt, "--resume")          # --gpus 1 from the checkpoint
    assert resumed["history"] == ddp["history"] and resumed["gpus"] == 1


def test_the_start_broadcast_covers_parameters_and_buffers():
    model = mt.Sequential(mt.SpatialConvolution(3, 4, 3), mt.SpatialBatchNormalization(4))
    arrays = distributed.model_state_arrays(model)
    state = model.named_parameters() + model.named_buffers()
    assert [id(a) for a in arrays] == [id(t.data) for _, t in state]
    assert {n for n, _ in model.named_buffers()} == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}


# -- several GPUs (a multi-GPU machine kind) -----------------------------------------------------

def _gpus():
    try:
        return distributed.visible_gpus()
    except Exception:
        return 0


needs_2_gpus = pytest.mark.skipif("_gpus() < 2", reason="needs 2 GPUs")

STEP_CHILD = textwrap.dedent("""
    import sys
    import cupy as cp, numpy as np
    import minitorch_fft as mt
    from minitorch_fft import distributed
    graphed, out, steps, per_rank = sys.argv[1] == "graph", sys.argv[2], 3, 64
    group = distributed.init_process_group(distributed.launched(), "nccl", timeout=60)
    n = group.world_size
    train, _ = mt.data.digits()
    batches = [(cp.asarray(x), y) for x, y in list(mt.data.batches(train, per_rank * n, seed=4))[:steps]]

    def net():      # no batch norm or dropout: per-rank statistics would differ from the whole batch's
        mt.manual_seed(group.rank + 7)                 # different on every rank: the broadcast fixes it
        return mt.Sequential(mt.SpatialConvolution(1, 8, 3, padding=1, backend="gemm"), mt.ReLU(),
                             mt.SpatialConvolution(8, 16, 3, padding=1, backend="gemm"), mt.ReLU(),
                             mt.SpatialMaxPooling(2, 2), mt.View(16 * 4 * 4), mt.Linear(256, 10)).to("cuda")

    def train_steps(model, parts, sync=None):
        opt = mt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        crit = mt.CrossEntropyCriterion()
        step = mt.graphs.GraphedStep(model, crit, opt, sync=sync) if graphed else None
        for x, y in parts:
            if step is not None:
                step(x, y)
            else:
                mt.train_step(model, crit, opt, mt.Tensor(x), cp.asarray(y), sync=sync)
        return [cp.asnumpy(p.data) for p in model.parameters()]

    with group.failing_together():
        model = net()
        group.broadcast_arrays(distributed.model_state_arrays(model))
        start = [cp.asnumpy(p.data) for p in model.parameters()]
        sync = distributed.GradientSync(model.parameters(), group, bucket_mb=0.01)
        mine = [(x[group.rank * per_rank:(group.rank + 1) * per_rank], y[group.rank * per_rank:(group.rank + 1) * per_rank])
                for x, y in batches]
        ddp = train_steps(model, mine, sync)
        gathered = [cp.asarray(p) for p in ddp]
        for a in gathered:                              # rank 0's parameters summed with the others'
            group.comm.all_reduce(a)
        if group.rank == 0:
            single = net()                              # one GPU, the whole batch, rank 0's start
            for p, s in zip(single.parameters(), start):
                p.data[...] = cp.asarray(s)
            whole = train_steps(single, batches)
            np.savez(out, n=n, buckets=len(sync.buckets), **{f"ddp{i}": a for i, a in enumerate(ddp)},
                     **{f"sum{i}": cp.asnumpy(a) for i, a in enumerate(gathered)},
                     **{f"one{i}": a for i, a in enumerate(whole)}, **{f"start{i}": a for i, a in enumerate(start)})
        group.barrier()
""")


@pytest.mark.gpu
@needs_2_gpus
@pytest.mark.parametrize("graphed", [False, True])
def test_n_gpus_train_as_one_gpu_with_n_times_the_batch(tmp_path, graphed):
    """The issue's check: after three steps on every visible GPU (batch 64 each, buckets of 10 KB
    all-reduced during backward), every rank holds the parameters of one GPU that trained on the
    whole 64 N-image batches, within fp32 tolerance (the sums run in another order)."""
    n = _gpus()
    script, out = tmp_path / "child.py", tmp_path / "params.npz"
    script.write_text(STEP_CHILD)
    launcher = ("import sys; from minitorch_fft import distributed; "
                f"sys.exit(distributed.spawn({n}, [sys.executable, {str(script)!r}, "
                f"{'graph' if graphed else 'eager'!r}, {str(out)!r}]))")
    res = subprocess.run([sys.executable, "-c", launcher], cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-3000:]
    got = np.load(out)
    assert int(got["n"]) == n and int(got["buckets"]) > 1
    k = len([f for f in got.files if f.startswith("ddp")])
    for i in range(k):
        ddp, one, start = got[f"ddp{i}"], got[f"one{i}"], got[f"start{i}"]
        assert not np.allclose(ddp, start)                                   # the steps moved it
        np.testing.assert_allclose(got[f"sum{i}"], n * ddp, rtol=1e-6, atol=0)  # every rank holds the same
        np.testing.assert_allclose(ddp, one, rtol=1e-4, atol=2e-6)


@pytest.mark.gpu
@needs_2_gpus
def test_train_py_on_2_gpus_resumes_exactly_and_sigterm_to_one_rank_stops_both(tmp_path):
    whole, err = _train_py("--epochs", "2", "--gpus", "2", timeout=300)
    assert "2 GPUs, batch 32 per GPU (64 a step)" in err and whole["gpus"] == 2
    ckpt = str(tmp_path / "run.ckpt")
    _train_py("--epochs", "2", "--gpus", "2", "--checkpoint", ckpt, "--max-epochs-this-run", "1", timeout=300)
    resumed, _ = _train_py("--checkpoint", ckpt, "--resume", timeout=300)
    assert resumed["history"] == whole["history"] and resumed["gpus"] == 2
    # SIGTERM to rank 1 of a long run, once its first checkpoint exists: both ranks end within
    # seconds, and the checkpoint loads
    long_ckpt = tmp_path / "long.ckpt"
    proc = subprocess.Popen([sys.executable, "train.py", "--backend", "gemm", "--no-progress", "--device", "cuda",
                             "--epochs", "200", "--gpus", "2", "--checkpoint", str(long_ckpt)], cwd=ROOT,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while not long_ckpt.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert long_ckpt.exists(), "no checkpoint within 120 s"
    ranks = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == proc.pid:
                env = (stat.parent / "environ").read_bytes().split(b"\0")
                ranks[int(next(e for e in env if e.startswith(b"RANK=")).split(b"=")[1])] = int(stat.parent.name)
        except (OSError, StopIteration, ValueError, IndexError):
            continue
    assert set(ranks) == {0, 1}, ranks
    t0 = time.monotonic()
    os.kill(ranks[1], signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 20 and proc.returncode != 0
    assert "rank 1: SIGTERM: stopping every rank" in err, err[-2000:]
    assert mt.checkpoint.header(str(long_ckpt))          # intact: it loads

"""Data-parallel training: one process per GPU, gradients all-reduced over NCCL.

    python train.py --model alexnet --data fake --gpus 4            # four processes, started here
    torchrun --nproc-per-node 4 train.py --model alexnet --data fake  # or by an external launcher

Every rank holds the whole model and trains on its own part of each batch; after backward the
gradients are averaged over the ranks (an NCCL all-reduce, ncclAvg: sum and 1/N in one kernel),
so every rank applies the same update and the parameters stay equal. Buffers do not: each
rank's batch norms track running statistics of its own shard (as PyTorch's
DistributedDataParallel without SyncBatchNorm does, apart from its per-step broadcast); rank 0's
are the ones evaluated and saved. --batch-size is per GPU: a step trains on batch_size *
world_size images.

- Launch. A rank learns who it is from the environment, as torchrun sets it (RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR, MASTER_PORT; read through backends.config). `spawn` is train.py
  --gpus N's own launcher: N children on this host, MASTER_ADDR 127.0.0.1, NCCL_NVLS_ENABLE=0 in
  every child (NVLink multicast can take GPUs that others share out of service).
- Rendezvous. Rank 0 makes the NCCL unique id and hands it to the others over TCP on
  MASTER_ADDR:MASTER_PORT (loopback for one host), within a bounded time. The connections stay
  open for the whole run: they are how a failing rank brings the others down (`Channel`).
- Faults. A rank that raises sends "fail <why>" before it exits; one that dies closes its socket.
  Either way every other rank prints why and exits (EXIT_PEER_FAILED) within a second or so,
  even while its main thread waits inside NCCL (a watch thread calls os._exit). SIGTERM / SIGINT
  to one rank does the same. Only rank 0 writes checkpoints, after a barrier, and atomically, so
  a run brought down keeps its last checkpoint and --resume (same --gpus) continues from it.
- Consistency. Every rank seeds alike (the same weights, dropout streams and RNG state, so rank
  0's checkpoint restores every rank), and rank 0's parameters (and buffers, model_state_arrays)
  are broadcast at the start all the same. Data is sharded by data.batches(rank, world_size):
  the same per-(seed, epoch) order as one process, each rank a disjoint slice of every global
  batch, so a resumed run sees the same images. Each rank tunes `auto` on its own GPU through
  the shared tuning cache and its lock; ranks that pick different backends differ by rounding
  in their local gradients only, and the averaged gradient, so the update, is the same on all.
- Gradients. `GradientSync` keeps them in one flat buffer per dtype, each parameter's .grad a
  view into it, cut into buckets in the order backward produces them (last layer first). The
  autograd engine calls a parameter's grad_hook once its gradient for the backward pass is
  complete (tensor.py: a leaf is visited after all its consumers), so a bucket's all-reduce is
  issued, on a stream of its own, as soon as its last gradient exists, while backward goes on
  with earlier layers. Under --cuda-graph the same calls are captured: the all-reduce stream
  forks from the capture stream and joins it before the update, one graph.
"""
import contextlib
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import namedtuple

import numpy as np

from .backends import config

from .device import get_array_module

EXIT_PEER_FAILED = 4          # this rank stopped because another one failed
RENDEZVOUS_TIMEOUT_S = 120    # how long ranks wait for each other at the start
TERMINATE_GRACE_S = 10        # spawn: how long children get to exit after SIGTERM, before SIGKILL
CAUSE_GRACE_S = 5             # spawn: how long the others get to end on their own after a rank's EXIT_PEER_FAILED
BUCKET_MB = 25                # gradient bucket size (PyTorch DDP's default)

Launch = namedtuple("Launch", "rank world_size local_rank master_addr master_port")


# -- who am I --------------------------------------------------------------------------------

def launched():
    """This process's Launch from the environment (torchrun's variables), or None when
    WORLD_SIZE is unset (not a data-parallel rank). ValueError names a variable that is missing
    or out of range."""
    world = config.get("world_size")
    if world is None:
        return None
    rank, local, addr, port = (config.get(n) for n in ("rank", "local_rank", "master_addr", "master_port"))
    if rank is None or rank >= world:
        raise ValueError(f"RANK={rank}: a rank 0 .. WORLD_SIZE-1 = {world - 1} is needed with WORLD_SIZE set")
    if world > 1 and (not addr or port is None or not 0 < port < 65536):
        raise ValueError(f"WORLD_SIZE={world} needs MASTER_ADDR and MASTER_PORT (1 .. 65535), got "
                         f"MASTER_ADDR={addr!r}, MASTER_PORT={port!r}")
    return Launch(rank, world, rank if local is None else local, addr or "127.0.0.1", port or 0)


def visible_gpus():
    """How many GPUs CuPy sees (0 without CuPy or a driver)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:      # noqa: BLE001 - no CuPy, no driver, no device: none visible
        return 0


def nccl_version():
    """NCCL's version as an int (e.g. 23007), or None where CuPy has no NCCL."""
    try:
        from cupy.cuda import nccl
        return nccl.get_version() if getattr(nccl, "available", True) else None
    except Exception:      # noqa: BLE001 - CuPy built without NCCL, or no CuPy
        return None


def check_launch(gpus, batch_size, n_train, device="auto", visible=None, nccl=None):
    """Refuse a data-parallel configuration before any process starts (ValueError naming the
    limit): gpus an int >= 1 and at most the GPUs visible, a device that is the GPU, NCCL there,
    and at least one full global batch (batch_size per GPU * gpus) in the training set."""
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"--gpus takes an integer >= 1, got {gpus!r}")
    if device not in ("auto", "cuda"):
        raise ValueError(f"--gpus runs on GPUs; --device {device} cannot go with it")
    visible = visible_gpus() if visible is None else visible
    if gpus > visible:
        raise ValueError(f"--gpus {gpus}: only {visible} GPU{'' if visible == 1 else 's'} visible "
                         "(CUDA_VISIBLE_DEVICES and CuPy decide which)")
    nccl = nccl_version() if nccl is None else nccl
    if not nccl:
        raise ValueError("--gpus needs NCCL, and CuPy has none here (install CuPy with NCCL, "
                         "e.g. pip install nvidia-nccl-cu13)")
    if n_train < batch_size * gpus:
        raise ValueError(f"--batch-size {batch_size} is per GPU: {gpus} GPUs take {batch_size * gpus} "
                         f"images a step, and the training set holds {n_train}; lower --batch-size "
                         "or --gpus")


# -- the launcher ----------------------------------------------------------------------------

def free_port(host="127.0.0.1"):
    """A TCP port free on `host` now (the OS picks it; it is free again once this returns)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn(world_size, command, prog="train.py", port=None, poll_s=0.1):
    """Run `command` (an argv list) as `world_size` processes on this host, ranks 0 .. N-1, and
    return the exit code: 0 when all end with 0, else the failure's cause. The rank that fails tells
    the others before it unwinds, so their EXIT_PEER_FAILED (4) often comes first: then every rank gets
    CAUSE_GRACE_S to end on its own, and the first code other than 0 and 4 is the answer (4 if there
    is none). The ranks still running are sent SIGTERM, and SIGKILL after TERMINATE_GRACE_S. SIGTERM /
    SIGINT here is passed on to them."""
    port = port or free_port()
    children = []
    for rank in range(world_size):
        env = config.environment_with(RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=rank,
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NCCL_NVLS_ENABLE=0)
        children.append(subprocess.Popen(command, env=env))
    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        failed = None
        while [c.poll() for c in children].count(None):     # poll() every child, each time
            if failed is None:
                failed = _failure(children)
                if failed is not None:
                    if failed[1] == EXIT_PEER_FAILED:   # told by the rank that failed: let it end with its own
                        _wait_all(children, CAUSE_GRACE_S)
                        failed = _failure(children, EXIT_PEER_FAILED) or failed
                    print(f"{prog}: rank {failed[0]} exited with status {failed[1]}; stopping the "
                          "other ranks", file=sys.stderr, flush=True)
                    _terminate(children)
            time.sleep(poll_s)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _terminate(children)
    if stopping:
        return 128 + stopping[0]
    # failed is None where every rank ended between two polls: the cause first, as above
    failed = failed or _failure(children, EXIT_PEER_FAILED) or _failure(children)
    return 0 if failed is None else failed[1]


def _failure(children, *but):
    """(rank, exit code) of the first child that has ended with a code other than 0 and `but`, or None."""
    return next(((r, c.returncode) for r, c in enumerate(children) if c.returncode not in (None, 0, *but)), None)


def _wait_all(children, seconds):
    """Wait up to `seconds` for every child to end (poll: no signal sent)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and [c.poll() for c in children].count(None):
        time.sleep(0.05)


def _terminate(children):
    for c in children:
        if c.poll() is None:
            c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for c in children:
        try:
            c.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()


# -- the rendezvous and fault channel ------------------------------------------------------------

class Channel:
    """Rank 0's TCP hub and every other rank's connection to it: it hands out the NCCL unique id
    (`uid`, bytes) at the start, then carries one message per rank: "done" at a clean end, or
    "fail <why>". A watch thread reads it for the whole run; a connection that ends without
    "done" (its process died) or a "fail" calls `on_failure(why)`, by default: print why and
    os._exit(EXIT_PEER_FAILED), which works while the main thread waits inside NCCL. Rank 0
    passes a failure on to every other rank before it stops."""

    def __init__(self, launch, make_uid, timeout=RENDEZVOUS_TIMEOUT_S, prog="train.py", on_failure=None):
        self.launch, self.prog = launch, prog
        self.on_failure = on_failure or self._exit
        self._lock, self._said, self._peers, self._hub = threading.Lock(), None, {}, None
        if launch.rank == 0:
            self.uid = make_uid()
            if launch.world_size > 1:
                self._serve(timeout)
        else:
            self.uid = self._join(timeout)
        if launch.world_size > 1:
            threading.Thread(target=self._watch, daemon=True, name="minitorch-ddp-watch").start()

    def _serve(self, timeout):
        L = self.launch
        deadline = time.monotonic() + timeout
        with socket.create_server((L.master_addr, L.master_port), backlog=L.world_size) as server:
            while len(self._peers) < L.world_size - 1:
                server.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    raise TimeoutError(f"rank 0: {len(self._peers) + 1} of {L.world_size} ranks met on "
                                       f"{L.master_addr}:{L.master_port} within {timeout} s") from None
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                (rank,) = struct.unpack("!I", _recv_exactly(conn, 4))
                if not 0 < rank < L.world_size or rank in self._peers:
                    conn.close()
                    raise ValueError(f"rank 0: a connection on {L.master_addr}:{L.master_port} "
                                     f"claimed rank {rank} (expected 1 .. {L.world_size - 1}, once)")
                conn.sendall(struct.pack("!I", len(self.uid)) + self.uid)
                conn.settimeout(None)
                self._peers[rank] = conn

    def _join(self, timeout):
        L = self.launch
        deadline = time.monotonic() + timeout
        while True:     # rank 0 may not listen yet
            try:
                conn = socket.create_connection((L.master_addr, L.master_port),
                                                timeout=max(0.01, deadline - time.monotonic()))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {L.rank}: rank 0 did not answer on {L.master_addr}:"
                                       f"{L.master_port} within {timeout} s") from None
                time.sleep(0.05)
        conn.sendall(struct.pack("!I", L.rank))
        (n,) = struct.unpack("!I", _recv_exactly(conn, 4))
        uid = _recv_exactly(conn, n)
        conn.settimeout(None)
        self._hub = conn
        return uid

    # -- messages --------------------------------------------------------------------------------
    def fail(self, why):
        """Tell the others this rank is failing (`why`: one line); they stop. This rank goes on
        to exit by itself."""
        self._send(f"fail rank {self.launch.rank}: {why}")

    def close(self):
        """A clean end: tell the others, stop watching."""
        self._send("done")

    def _send(self, message):
        """Say `message` ("done" or "fail ...") to the other end(s), once: what is said first stays."""
        with self._lock:
            if self._said is not None:
                return
            self._said = message.split()[0]
            for conn in ([self._hub] if self._hub else list(self._peers.values())):
                with contextlib.suppress(OSError):
                    conn.sendall(message.replace("\n", " ").encode() + b"\n")
                    conn.shutdown(socket.SHUT_WR)

    def _watch(self):
        if self._hub is not None:
            why = _read_message(self._hub, "rank 0")
            if why is not None and self._said is None:    # a rank that said its word exits by itself
                self.on_failure(why)
            return
        sel = selectors.DefaultSelector()
        for rank, conn in self._peers.items():
            sel.register(conn, selectors.EVENT_READ, rank)
        open_ = len(self._peers)
        while open_:
            for key, _ in sel.select():
                sel.unregister(key.fileobj)
                open_ -= 1
                why = _read_message(key.fileobj, f"rank {key.data}")
                if why is not None and self._said is None:
                    self._send(f"fail {why}")          # pass it on to the other ranks, then stop
                    self.on_failure(why)
                    return

    def _exit(self, why):
        print(f"{self.prog}: rank {self.launch.rank}: stopping because {why}", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_FAILED)


def _recv_exactly(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the rendezvous connection closed before its message ended")
        data += chunk
    return data


def _read_message(conn, who):
    """Read `who`'s one message: None for "done", else why it failed."""
    data = b""
    with contextlib.suppress(OSError):
        while not data.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
    text = data.decode("utf-8", "replace").strip()
    if text == "done":
        return None
    if text.startswith("fail "):
        return text[5:]
    return f"{who} ended without a word (its process died, or its host is gone)"


# -- communicators ----------------------------------------------------------------------------

class FakeCommunicator:
    """The communicator of a world of one process, without NCCL (CPU, tests): the sum over one
    rank is the array itself, and so is rank 0's broadcast. More ranks need NcclCommunicator."""

    def __init__(self, rank=0, world_size=1):
        self.rank, self.world_size = rank, world_size

    def _one(self, what):
        if self.world_size != 1:
            raise RuntimeError(f"FakeCommunicator {what}s over one process only (world size "
                               f"{self.world_size}): use NcclCommunicator")

    def all_reduce(self, array, stream=None, average=False):
        self._one("all-reduce")          # the sum and the mean over one rank are the array

    def broadcast(self, array, root=0, stream=None):
        self._one("broadcast")

    def barrier(self):
        self._one("barrier")


def make_nccl_uid():
    """A new NCCL unique id as 128 bytes (what rank 0 hands out)."""
    from cupy.cuda import nccl
    return bytes(b & 0xFF for b in nccl.get_unique_id())


class NcclCommunicator:
    """One rank's NCCL communicator (cupy.cuda.nccl) on the current GPU. The collectives run
    in place on a contiguous CuPy array, on `stream` (default: the current stream); NCCL allows
    them inside a CUDA-graph capture on a non-default stream."""

    def __init__(self, uid, rank, world_size):
        import cupy as cp
        from cupy.cuda import nccl
        self.cp, self.nccl, self.rank, self.world_size = cp, nccl, rank, world_size
        try:                                            # waits until every rank has joined
            self.comm = nccl.NcclCommunicator(world_size, bytes(uid), rank)
        except TypeError:    # older CuPy takes the id as a tuple of 128 signed chars
            self.comm = nccl.NcclCommunicator(world_size, tuple(b - 256 if b > 127 else b for b in uid), rank)
        # ncclAvg (NCCL >= 2.10; 4 in nccl.h, which older CuPy does not name) scales while it
        # reduces; before it, the mean is the sum and a pass of its own
        self._avg = getattr(nccl, "NCCL_AVG", 4) if nccl.get_version() >= 21000 else None
        self._dtypes = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                        np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.int32): nccl.NCCL_INT32,
                        np.dtype(np.int64): nccl.NCCL_INT64}

    def _args(self, array, stream):
        if not array.flags.c_contiguous:
            raise ValueError("NCCL collectives work on contiguous arrays")
        stream = stream or self.cp.cuda.get_current_stream()
        return array.data.ptr, array.size, self._dtypes[array.dtype], stream.ptr

    def all_reduce(self, array, stream=None, average=False):
        """array = the sum of every rank's array, in place; average=True: the mean (floating
        arrays), in the same kernel where NCCL has ncclAvg."""
        ptr, n, dtype, s = self._args(array, stream)
        op = self._avg if average and self._avg is not None else self.nccl.NCCL_SUM
        self.comm.allReduce(ptr, ptr, n, dtype, op, s)
        if average and op == self.nccl.NCCL_SUM and self.world_size > 1:
            with stream or self.cp.cuda.get_current_stream():
                array *= array.dtype.type(1.0 / self.world_size)

    def broadcast(self, array, root=0, stream=None):
        """array = rank `root`'s array, in place."""
        ptr, n, dtype, s = self._args(array, stream)
        self.comm.broadcast(ptr, ptr, n, dtype, root, s)

    def barrier(self):
        """Returns once every rank has reached it (a one-element all-reduce, waited for)."""
        one = self.cp.ones(1, np.float32)
        self.all_reduce(one)
        self.cp.cuda.get_current_stream().synchronize()

    def abort(self):
        with contextlib.suppress(Exception):
            self.comm.abort()


# -- the process group ------------------------------------------------------------------------

class ProcessGroup:
    """This rank's place in the run: rank, world_size, its communicator and its channel."""

    def __init__(self, rank, world_size, comm, channel=None, prog="train.py"):
        self.rank, self.world_size, self.comm, self.channel, self.prog = rank, world_size, comm, channel, prog

    def barrier(self):
        self.comm.barrier()

    def broadcast_arrays(self, arrays, root=0):
        """Every array = rank `root`'s, in place (the start of a run: model_state_arrays)."""
        for a in arrays:
            self.comm.broadcast(a, root)

    def sum_host(self, values):
        """The sum over ranks of a few numbers (epoch statistics), as float64 NumPy."""
        values = np.asarray(values, np.float64)
        if self.world_size == 1:
            return values
        cp = self.comm.cp
        dev = cp.asarray(values)
        self.comm.all_reduce(dev)
        return cp.asnumpy(dev)

    def on_signal(self, signum, frame):
        """SIGTERM / SIGINT to one rank stops every rank (the last checkpoint stays)."""
        name = signal.Signals(signum).name
        print(f"{self.prog}: rank {self.rank}: {name}: stopping every rank (the last checkpoint "
              "stays; --resume with the same --gpus continues from it)", file=sys.stderr, flush=True)
        if self.channel:
            self.channel.fail(f"stopped by {name}")
        os._exit(128 + signum)

    @contextlib.contextmanager
    def failing_together(self):
        """The run's body: an exception in it tells every other rank (which stop); a clean end
        says "done"."""
        try:
            yield self
        except BaseException as e:
            if self.channel:
                self.channel.fail(f"{type(e).__name__}: {e}")
            raise
        if self.channel:
            self.channel.close()


def init_process_group(launch, communicator="nccl", prog="train.py", timeout=RENDEZVOUS_TIMEOUT_S):
    """This rank's ProcessGroup: the rendezvous (rank 0 makes the id, the channel hands it out),
    then the communicator ("nccl", on GPU launch.local_rank, made current here; or "fake")."""
    if communicator == "nccl":
        import cupy as cp
        cp.cuda.Device(launch.local_rank).use()
        make_uid = make_nccl_uid
    elif communicator == "fake":
        def make_uid():
            return os.urandom(128)
    else:
        raise ValueError(f"communicator must be 'nccl' or 'fake', got {communicator!r}")
    channel = Channel(launch, make_uid, timeout=timeout, prog=prog)
    if communicator == "nccl":
        comm = NcclCommunicator(channel.uid, launch.rank, launch.world_size)
    else:
        comm = FakeCommunicator(launch.rank, launch.world_size)
    group = ProcessGroup(launch.rank, launch.world_size, comm, channel, prog)
    group.uid = channel.uid
    return group


def model_state_arrays(model):
    """The arrays every rank must hold alike, in a fixed order: each parameter's data once
    (named_parameters(), tied weights once), then each buffer's (BatchNorm's running statistics
    and count), so the broadcast at the start leaves every rank with rank 0's whole state."""
    seen, out = set(), []
    for _, t in model.named_parameters() + model.named_buffers():
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t.data)
    return out


# -- gradients ---------------------------------------------------------------------------------

class GradientSync:
    """Gradients in one flat buffer per dtype (every parameter's .grad a view into it),
    all-reduced in buckets as backward completes them, averaged over the ranks.

        sync = GradientSync(model.parameters(), group)
        train_step(model, criterion, opt, x, y, sync=sync)   # begin(), backward, finish(), update

    The layout follows the order backward finishes gradients, the reverse of the parameters'
    (the last layer's first), so a bucket is a contiguous slice and is complete early. On the
    GPU a bucket's all-reduce (the mean, ncclAvg) runs on a stream of its own, after an event
    on the compute stream; finish() makes the compute stream wait for it. On the CPU (the fake
    communicator, one rank) the same calls run in order.

    One backward per step (gradient accumulation over several backwards is not supported: the
    first would launch the buckets). A parameter backward does not reach keeps grad None."""

    def __init__(self, params, group, bucket_mb=BUCKET_MB):
        self.params, self.group = list(params), group
        xp = get_array_module(self.params[0].data)
        self.xp, self.cp = xp, (None if xp is np else xp)
        order = self.params[::-1]
        self.flat, self.buckets, self._where = {}, [], {}
        limit = max(1, int(bucket_mb * 2**20))
        for dtype in dict.fromkeys(p.data.dtype for p in order):
            members = [p for p in order if p.data.dtype == dtype]
            flat = xp.zeros(sum(p.data.size for p in members), dtype)
            self.flat[dtype] = flat
            start, bucket = 0, None
            for p in members:
                if bucket is None or (bucket["stop"] - bucket["start"]) * flat.itemsize >= limit:
                    bucket = {"flat": flat, "start": start, "stop": start, "params": []}
                    self.buckets.append(bucket)
                view = flat[start:start + p.data.size].reshape(p.data.shape)   # (p's shape)
                self._where[id(p)] = (view, len(self.buckets) - 1)
                bucket["params"].append(p)
                start += p.data.size
                bucket["stop"] = start
        self.stream = self.cp.cuda.Stream(non_blocking=True) if self.cp else None
        if self.cp:       # made here, not inside a CUDA-graph capture: one per bucket, one to join
            self._ready = [self.cp.cuda.Event(disable_timing=True) for _ in self.buckets]
            self._done = self.cp.cuda.Event(disable_timing=True)
        self._pending = self._launched = None
        for p in self.params:
            p.grad_hook = self._on_grad

    def view(self, p):
        """The slice of the flat buffer that is p's gradient (p.grad once backward reached p)."""
        return self._where[id(p)][0]

    def begin(self):
        """Before backward: no bucket is filled or launched yet."""
        self._pending = [len(b["params"]) for b in self.buckets]
        self._launched = [False] * len(self.buckets)

    def _on_grad(self, p, g):
        """The autograd engine's hook: g is p's whole gradient of this backward."""
        view, i = self._where[id(p)]
        if p.grad is view:
            view += g
        else:
            view[...] = g if p.grad is None else p.grad + g
            p.grad = view
        if self._pending is None:            # a backward outside begin()/finish(): no sync
            return
        self._pending[i] -= 1
        if self._pending[i] == 0:
            self._launch(i)

    def _launch(self, i):
        b = self.buckets[i]
        self._launched[i] = True
        seg = b["flat"][b["start"]:b["stop"]]
        if self.cp is None:
            self.group.comm.all_reduce(seg, average=True)
            return
        ready = self._ready[i]
        ready.record(self.cp.cuda.get_current_stream())   # the bucket's gradients are written
        self.stream.wait_event(ready)
        self.group.comm.all_reduce(seg, self.stream, average=True)

    def finish(self):
        """After backward: launch the buckets not yet complete (a parameter backward did not
        reach adds zeros), and make the compute stream wait for every all-reduce. With several
        ranks such a parameter's .grad becomes the all-reduced view: another rank may have reached
        it, and every rank must then update it alike. With one, it keeps no gradient, as in plain
        training."""
        if self._pending is None:
            raise RuntimeError("GradientSync.finish() without begin()")
        for i, b in enumerate(self.buckets):
            if not self._launched[i]:
                for p in b["params"]:
                    view = self._where[id(p)][0]
                    if p.grad is not view:
                        view[...] = 0
                        if self.group.world_size > 1:
                            p.grad = view
                self._launch(i)
        if self.cp is not None:
            self._done.record(self.stream)
            self.cp.cuda.get_current_stream().wait_event(self._done)
        self._pending = None

    def remove(self):
        """Detach from the parameters (their grad_hook back to None)."""
        for p in self.params:
            p.grad_hook = None


# -- train.py's side -------------------------------------------------------------------------

def join(args, prog="train.py"):
    """train.py in a rank (WORLD_SIZE set): its ProcessGroup, or None when not data-parallel.
    --gpus, if given (or restored from a checkpoint), must equal WORLD_SIZE; the device is GPU
    LOCAL_RANK."""
    launch = launched()
    if launch is None:
        return None
    if args.gpus is not None and args.gpus != launch.world_size:
        raise ValueError(f"--gpus {args.gpus} but the launcher started WORLD_SIZE={launch.world_size} "
                         "processes (a resumed run keeps its --gpus)")
    if args.device not in ("auto", "cuda"):
        raise ValueError(f"a data-parallel rank runs on its GPU; --device {args.device} cannot go with it")
    return init_process_group(launch, "nccl", prog)


def is_rank0():
    """True unless this process is a data-parallel rank other than 0."""
    launch = launched()
    return launch is None or launch.rank == 0

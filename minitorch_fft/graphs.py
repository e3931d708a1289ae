"""A whole training step as one CUDA graph: captured once, replayed for every batch.

An eager step issues a few hundred kernels, GEMMs and FFTs from Python, one at a time; where
they are short (the small layers, the element-wise ops, the update) the GPU waits for Python.
`GraphedStep` runs the step eagerly for `warmup` batches (that is where `auto` tunes, kernels
compile, cuFFT plans and the optimiser's buffers are made), then captures it on a stream of its
own (cudaStreamBeginCapture / EndCapture through CuPy) and from then on issues the whole step
with one cudaGraphLaunch.

A graph replays fixed addresses with fixed kernel arguments, which decides how this works:
- Inputs go through static buffers: each call copies its batch into them, then launches. Where
  the caller passes the very array of the warm-up step again at the capture, the graph reads that
  array in place instead (`borrowed`; no copy, and no second copy of the batch on the device)
  for as long as the calls pass an array at its address. The replay reads it until the step ends:
  refill it in order on the caller's stream (as a copy or kernel there is), not from another.
- Memory the step allocates comes from a pool of the graph's own (cupy.cuda.MemoryPool), never
  used for anything else, so no array allocated outside can land where the graph writes. A pool
  that grows as the capture asks came out 1.3-2.2x the bytes the step held at once (AlexNet,
  ResNet-18; exp_graph_pool, session 25), so the step is captured twice: the first capture records
  every allocation's size and lifetime, plan_arena lays them out in one arena (blocks alive at the
  same time never overlap), and the second capture takes its memory from there. Where the second
  capture's allocations differ from the first's in any size or lifetime, it is captured a third
  time from the pool alone. What a
  backend keeps across calls (cufft's scratch buffers and plans, cudnn's built plans:
  backends.held_on_device) is held by the graph as well, so a buffer that grows later, a plan
  evicted from its cache, or a cache an out-of-memory fallback drops is not freed under it.
- The parameters, the module buffers (BatchNorm's running statistics), the optimiser's momentum
  buffers, the learning rate and the modes (training, TF32, spectra reuse) are baked in. Layers
  update buffers in place, so each replay moves the running statistics in the memory the graph
  holds. They make the graph's key: when one changes (an lr schedule,
  load_state_dict, model.to()), the next call captures again.
- Dropout masks come from a Philox counter on the device (minitorch_fft.random), so every replay
  draws new ones; cuBLAS runs on a handle and workspace of the graph's own (backends.cgemm: CuPy
  refuses cuBLAS calls during capture).
- Nothing in the captured step may wait for the host: the targets' range check, which would, is
  done by the call before the replay instead.
- Data-parallel (sync, a distributed.GradientSync): the gradients' all-reduce is captured too,
  on the sync's stream, forked from the capture stream by an event and joined before the update;
  its flat gradient buffer lives outside the graph's pool, at a fixed address.
"""
import contextlib

import numpy as np

from . import functional as F
from .device import get_array_module
from .tensor import Tensor
from .training import train_step

ARENA = True   # capture into a planned arena (False: the graph's pool as the capture asks)
ARENA_GAIN = 1.0   # the plan is used where its arena is under this x the first capture's growth
ALIGN = 512    # CuPy's pool rounds every block to this; so does the arena
PLAN_WORK = 50_000   # plan_arena's search: at most this many block placements (~1.3 s on AlexNet)
PLAN_MANY = 1000     # no search past this many blocks (it would get 50 tries or fewer there)


class GraphedStep:
    """step = GraphedStep(model, criterion, optimizer); loss, logits = step(x, y)

    One training step per call (forward, backward, optimiser update, in train.py's order), on the
    GPU (sync: a distributed.GradientSync, for data-parallel training). x: float32 (batch, ...) and y: integer (batch,) class indices, CuPy or NumPy arrays (or a
    Tensor for x), the same shapes at every call. Returns the loss (0-d) and the logits as CuPy
    arrays of their own (copies: the graph's buffers are overwritten by the next replay)."""

    def __init__(self, model, criterion, optimizer, reuse_spectra=True, warmup=1, sync=None):
        params = model.parameters()
        if not params or get_array_module(params[0].data) is np:
            raise ValueError("GraphedStep needs the model on the GPU (model.to('cuda')): CUDA graphs "
                             "replay GPU work only")
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an int >= 1 (the eager steps that tune and allocate "
                             f"before the capture), got {warmup!r}")
        import cupy as cp
        self.cp, self.model, self.criterion, self.optimizer = cp, model, criterion, optimizer
        self.reuse_spectra, self.warmup, self.sync = reuse_spectra, warmup, sync
        self._modules = model.modules()
        self.calls = self.captures = 0
        self._eager_left = warmup      # eager steps before the next capture
        self.stream = cp.cuda.Stream(non_blocking=True)   # the legacy stream cannot be captured
        self.pool = cp.cuda.MemoryPool()
        self.graph = self.key = self.x = self.y = self.handle = self._last_x = None
        self.borrowed = False          # self.x is the caller's array (no copy a call)
        self.loss = self.logits = self.n_classes = self._pinned = self._staged = None
        self._held, self._arena = [], None
        self.records, self.arena_plan = 0, None   # captures made last time; (arena, pool growth) bytes
        self.plan_miss = None                     # why the last plan was not taken (_Planned.miss)

    # -- the step itself ----------------------------------------------------------------------
    def _step(self, x, y):
        loss, logits = train_step(self.model, self.criterion, self.optimizer, x, y, self.reuse_spectra,
                                  self.sync)
        return loss.data, logits.data

    def _graph_key(self):
        """What the captured graph has baked in; a change means capturing again: the optimiser's
        settings, the addresses of parameters, module buffers and momentum buffers, which
        parameters train, every module's scalar settings (training mode, Dropout's p, a layer's
        backend, ...), every setting that changes what a pass computes or launches (backends.config.snapshot(): the
        GEMM precision, the workspace sizes, the tuning modes) and spectrum reuse."""
        from .backends import config
        opt = self.optimizer
        return (opt.lr, opt.momentum, opt.weight_decay,
                tuple(p.data.data.ptr for p in opt.params), tuple(p.requires_grad for p in opt.params),
                tuple(None if v is None else v.data.ptr for v in opt.velocity),
                tuple(b.data.data.ptr for b in self.model.buffers()),
                tuple(_settings(m) for m in self._modules), config.snapshot(), self.reuse_spectra)

    # -- a call -------------------------------------------------------------------------------
    def __call__(self, x, y):
        cp = self.cp
        x, y = self._inputs(x, y)
        key = self._graph_key()
        if self.graph is not None and key != self.key:
            # Something baked in changed. One eager step first: a new precision or a new layer
            # setting may need tuning, which cannot run inside a capture.
            self.graph, self._eager_left = None, 1
        if self._eager_left > 0:
            loss, logits = self._step(Tensor(x), cp.asarray(y, dtype=np.int64))  # checks the targets
            self.calls, self._eager_left, self.n_classes = self.calls + 1, self._eager_left - 1, logits.shape[1]
            self._last_x = x                  # held: the next call may pass it again (see _capture)
            return loss, logits
        if self.borrowed and (x.data.ptr != self.x.data.ptr or not x.flags.c_contiguous):
            # a batch in another array: from now on through a static buffer of the graph's own
            self.x, self.borrowed, self.graph = cp.empty(x.shape, np.float32), False, None
        if self.graph is None:
            self._capture(x, self._graph_key())
        current = cp.cuda.get_current_stream()
        s = self.stream
        s.wait_event(current.record())        # the batch's producers first
        with s:
            if not self.borrowed:
                self.x[...] = x
            self._copy_targets(y)
            self.graph.launch(s)
            out = self.loss.copy(), self.logits.copy()
        current.wait_event(s.record())        # later work on the caller's stream after the step
        self.calls += 1
        return out

    def release(self):
        """Let go of the graph and the device memory it holds: its pool (the arena; blocks the
        backends' caches made in a capture stay until the caches drop them), its static
        input (or the caller's array it read in place) and targets, the backend buffers kept for it and the cuBLAS workspace. The
        parameters' gradients point into that memory after a replay: they become None. The next
        call runs one eager step (a batch of a new shape may need tuning and cuFFT plans, which a
        capture cannot make), then captures again."""
        self.cp.cuda.Device().synchronize()      # nothing the graph launched still runs
        self.graph = self.key = self.loss = self.logits = None
        self.x = self.y = self._pinned = self._staged = self.handle = self._last_x = None
        self.borrowed = False                    # a caller's input is not held past this
        self._held, self._arena = [], None
        for p in self.optimizer.params:
            p.grad = None
        self._eager_left = max(self._eager_left, 1)
        self.pool.free_all_blocks()

    def _inputs(self, x, y):
        """x as a float32 CuPy array, y as given (NumPy or CuPy), both of the first call's shapes;
        y's values checked here, outside the graph (once a warm-up step has shown the number of
        classes): on the host when y is a NumPy array, else with one wait for the GPU."""
        cp = self.cp
        x = x.data if isinstance(x, Tensor) else x
        if isinstance(y, Tensor):
            raise TypeError("targets must be an integer array of class indices, not a Tensor")
        if not isinstance(y, cp.ndarray):
            y = np.asarray(y)
        if y.dtype.kind not in "iu":
            raise TypeError(f"targets must be integer class indices, got dtype {y.dtype}")
        if self.x is not None and (tuple(x.shape) != self.x.shape or y.shape != self.y.shape):
            raise ValueError(f"GraphedStep: batch of shape x {tuple(x.shape)}, y {y.shape}; the graph "
                             f"was made for x {self.x.shape}, y {self.y.shape} (every batch must have "
                             f"the same shape: drop or pad the last one, or run it eagerly)")
        if self.n_classes is not None:
            F.check_target_range(y, self.n_classes)
        return cp.asarray(x, dtype=np.float32), y

    def _copy_targets(self, y):
        """y into the static buffer, on the graph's stream. From NumPy through a pinned staging
        buffer: an asynchronous copy, so the host does not wait for the GPU here; the buffer is
        rewritten only once the previous batch's copy out of it is done."""
        cp = self.cp
        if isinstance(y, cp.ndarray):
            self.y[...] = y
            return
        if self._staged is not None:
            self._staged.synchronize()
        self._pinned[...] = y
        self.y.set(self._pinned, stream=self.stream)
        self._staged = self.stream.record()

    def _capture(self, x, key):
        import cupyx

        from .backends import cgemm
        cp = self.cp
        self.graph = self.loss = self.logits = None         # the old graph's memory is free again
        borrow = x is self._last_x and x.flags.c_contiguous
        self._last_x = None                                 # not held beside a static buffer
        if self.x is None:                                  # static inputs (the default pool)
            # The caller's array itself where it passes the same one again (a buffer it refills in
            # place, or one batch timed over and over): the graph reads it where it is, held so
            # that its memory stays its own, and a call with another array switches to a copy.
            # The graph never writes it. It reads it all through the step (the first layer's
            # weight gradient comes last), so a refill must follow the call on its stream.
            self.borrowed = borrow
            self.x = x if self.borrowed else cp.empty(x.shape, np.float32)
            self.y = cp.zeros(x.shape[:1], np.int64)        # valid class indices while capturing
            self._pinned, self._staged = cupyx.empty_pinned(x.shape[:1], np.int64), None
        s = self.stream
        s.wait_event(cp.cuda.get_current_stream().record())
        if self.handle is None:
            with cp.cuda.using_allocator(self.pool.malloc):
                self.handle = cgemm.GraphHandle(s.ptr, cp.empty(cgemm.GRAPH_WORKSPACE_BYTES, np.uint8))
        self._arena = self.plan_miss = None
        self.pool.free_all_blocks()           # what an earlier graph left: the growth below is this one's
        before = self.pool.total_bytes()
        self.records = 0
        if not ARENA or self.sync is not None:
            # not with a data-parallel sync: its all-reduce runs on a stream of its own, and the
            # plan knows one stream's order only
            self._record(key, self.pool.malloc)
            self.captures += 1
            return
        velocity = list(self.optimizer.velocity)
        lifetimes = _Lifetimes.make(cp, self.pool.malloc)
        with lifetimes:
            self._record(key, self.pool.malloc)
            grown, ended = self.pool.total_bytes() - before, lifetimes.tick
            self._drop_graph(velocity)
        # blocks the backends' caches hold after the drop (cuFFT plans, scratch buffers made in this
        # capture): the next capture finds them made and asks for none of them. The others still
        # held (the parameters' gradients) it asks for again, and they live on past it.
        from . import backends
        cached = _pointers(backends.held_on_device())
        blocks = _expected(lifetimes.blocks, ended, [p in cached for p in lifetimes.ptrs])
        offsets, size = plan_arena(blocks)
        self.arena_plan = (size, grown)
        for p in self.optimizer.params:       # the first capture's, never written: the second
            p.grad = None                     # makes its own (and the arena needs the room)
        arena = None
        if size < ARENA_GAIN * grown:
            try:
                with s:
                    arena = self.pool.malloc(size)
            except cp.cuda.memory.OutOfMemoryError:
                # the device has not `size` bytes free: the pool may still find the step its
                # blocks one by one, reusing what it frees as the first capture did
                self.plan_miss = f"no room for the {size} B arena"
        if arena is not None:
            planned = _Planned(cp, arena, blocks, offsets, self.pool.malloc)
            self._record(key, planned.malloc)
            if planned.matched():
                self._arena = arena
                self.captures += 1
                self.pool.free_all_blocks()   # the first capture's gradients, replaced by the second's
                return
            self.plan_miss = planned.miss
            self._drop_graph(velocity)        # the second capture went another way: no plan
            for p in self.optimizer.params:
                p.grad = None                 # the second capture's, views of the arena, never written
            del arena, planned
            self.pool.free_all_blocks()
        self._record(key, self.pool.malloc)
        self.captures += 1

    def _drop_graph(self, velocity):
        """Forget a graph that never ran, and let its pool's free blocks go. The optimiser's
        momentum buffers are `velocity` again: one the capture made was never initialised, and a
        later capture that found it would bake in reading it."""
        self.graph = self.loss = self.logits = None
        self._held = []
        self.optimizer.velocity = list(velocity)
        self.pool.free_all_blocks()

    def _record(self, key, malloc):
        """Capture one step on the graph's stream, its memory from `malloc`."""
        from . import backends
        from .backends import cgemm
        cp, s, opt = self.cp, self.stream, self.optimizer
        self.records += 1
        velocity = list(opt.velocity)          # a buffer made in the capture is never initialised
        with cp.cuda.using_allocator(malloc):
            with s, cgemm.capturing(self.handle), _prechecked_targets(), \
                    backends.cufft.keeping_retired() as retired:
                s.begin_capture()
                try:
                    loss, logits = self._step(Tensor(self.x), self.y)
                except BaseException as e:
                    with contextlib.suppress(Exception):
                        s.end_capture()               # leave the stream usable
                    opt.velocity = velocity
                    if not isinstance(e, Exception) or isinstance(e, MemoryError):
                        raise                         # Ctrl-C, or out of memory as an eager step says it
                    raise RuntimeError(f"GraphedStep: the training step could not be captured as a "
                                       f"CUDA graph ({type(e).__name__}: {e}); something in it waits "
                                       f"for the host or calls a library CuPy cannot capture. Run the "
                                       f"step eagerly instead (train.py without --cuda-graph)") from e
                graph = s.end_capture()
        self.loss, self.logits = loss, logits
        self.graph, self.key = graph, key
        # buffers and plans the graph's addresses point into, those evicted during the capture too
        self._held = backends.held_on_device() + retired


def plan_arena(blocks, align=ALIGN):
    """(offsets, arena bytes): a place in one arena for each block of `blocks`, [(bytes, start,
    end)] with start < end on one clock (end None: alive after the capture), such that two blocks
    alive at the same moment never share a byte. A block alive after the capture (a gradient, the
    loss) is alive from its start on: before it, a replay may use its bytes for a block let go
    earlier in the step, as CuPy's pool does in a capture (session 26: counted alive from the
    beginning, AlexNet's gradients kept its plan at 860 MiB against 694 in use at once). Each
    block in turn goes to the lowest offset free over its lifetime, the turns in the orders of
    offline memory planners (largest first, longest-lived first, largest size x lifetime first,
    and the order of the requests, as the pool itself did): the smallest arena of these. Where it
    is still over the most bytes alive at one moment (a bound no plan goes under), a short search
    moves one block to another turn at a time and keeps each move that does not grow the arena
    (session 27: AlexNet's plan 820.5 -> 790.0 MiB against 789.4 alive at once). The search is
    seeded and bounded by PLAN_WORK block placements: the same blocks get the same plan (with one
    NumPy). Past PLAN_MANY blocks it is left out: each try places every block, and its few tries
    rarely gain (ResNet-18's pool was within 2 % of its capture's high-water mark without
    it, session 26). Offsets and sizes are multiples of `align`."""
    n = len(blocks)
    if n == 0:
        return [], 0
    sizes = np.array([-(-b[0] // align) * align for b in blocks], dtype=np.int64)
    start = np.array([b[1] for b in blocks], dtype=np.float64)
    end = np.array([np.inf if b[2] is None else b[2] for b in blocks], dtype=np.float64)
    life = np.minimum(end, start.max() + 1) - start
    orders = [np.lexsort((start, -sizes)), np.lexsort((-sizes, -life)), np.lexsort((start, -sizes * life)),
              np.argsort(start, kind="stable")]
    plans = [_first_fit(sizes, start, end, order) for order in orders]
    k = min(range(len(plans)), key=lambda i: plans[i][1])
    order, (offsets, size) = list(orders[k]), plans[k]
    floor = _most_alive(sizes, start, end)
    rng = np.random.default_rng(0)
    for _ in range(PLAN_WORK // n if n <= PLAN_MANY else 0):
        if size <= floor:
            break
        moved = list(order)
        i, j = rng.integers(n, size=2)
        moved.insert(j, moved.pop(i))
        found = _first_fit(sizes, start, end, moved)
        if found[1] <= size:           # equal too: a sideways move lets the search go on
            order, (offsets, size) = moved, found
    return offsets, size


def _most_alive(sizes, start, end):
    """The most bytes alive at one moment: no placement of these blocks takes less."""
    times = np.concatenate((start, end[np.isfinite(end)]))
    steps = np.concatenate((sizes, -sizes[np.isfinite(end)]))
    by_time = np.lexsort((steps, times))     # at one tick, what ends goes before what starts
    return int(np.cumsum(steps[by_time]).max())


def _first_fit(sizes, start, end, order):
    """plan_arena's placement, the blocks taken in `order`: (offsets, arena bytes)."""
    n = len(sizes)
    lo, hi = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    for i in order:
        busy = placed & (start < end[i]) & (start[i] < end)
        offset = 0
        if busy.any():
            by_offset = np.argsort(lo[busy], kind="stable")
            b_lo, b_hi = lo[busy][by_offset], hi[busy][by_offset]
            reach = np.concatenate(([0], np.maximum.accumulate(b_hi)))   # highest end below each
            fits = np.nonzero(b_lo - reach[:-1] >= sizes[i])[0]
            offset = int(reach[fits[0]]) if fits.size else int(reach[-1])
        lo[i], hi[i], placed[i] = offset, offset + sizes[i], True
    return [int(v) for v in lo], int(hi.max())


def _expected(blocks, ended, cached):
    """The blocks a second capture of the same step asks for, in order, on a clock of its own
    (`ended`: the first tick after the first capture's step, where the drop of its graph began):
    all but those a cache holds after the first capture's graph was dropped (`cached`, one flag a
    block: made once). One let go only with the graph (loss, logits, what the graph held) or not
    at all (a parameter's gradient) is alive at the end."""
    kept = [[n, a, None if b is None or b >= ended else b]
            for (n, a, b), in_cache in zip(blocks, cached) if not (b is None and in_cache)]
    times = sorted({t for _, a, b in kept for t in (a, b) if t is not None})
    renumber = {t: k for k, t in enumerate(times)}
    return [[n, renumber[a], None if b is None else renumber[b]] for n, a, b in kept]


def _pointers(held):
    """The device addresses of the allocations behind `held` (arrays, and cuFFT plans' work areas)."""
    found = set()
    for h in held:
        for pointer in (getattr(h, "data", None), getattr(h, "work_area", None)):
            mem = getattr(pointer, "mem", None)
            if mem is not None:
                found.add(mem.ptr)
    return found


class _Lifetimes:
    """`with _Lifetimes.make(cp, malloc) as rec:` rec.blocks, [bytes, start, end] of each block
    handed out inside the block while `malloc` is CuPy's allocator (end None while alive), and
    rec.ptrs their addresses, on a
    clock (rec.tick) that ticks at each hand-out and return (a cupy MemoryHook: this thread's)."""

    @staticmethod
    def make(cp, malloc):
        class Hook(cp.cuda.MemoryHook):
            name = "minitorch_graph_lifetimes"

            def __init__(self):
                self.blocks, self.ptrs, self._open, self.tick = [], [], {}, 0

            def malloc_postprocess(self, mem_ptr, mem_size, **_):
                if mem_ptr and cp.cuda.get_allocator() == malloc:
                    self._open[mem_ptr] = len(self.blocks)
                    self.blocks.append([mem_size, self.tick, None])
                    self.ptrs.append(mem_ptr)
                    self.tick += 1

            def free_postprocess(self, mem_ptr, **_):
                i = self._open.pop(mem_ptr, None)
                if i is not None:
                    self.blocks[i][2] = self.tick
                    self.tick += 1
        return Hook()


class _Planned:
    """The second capture's allocator: the i-th request gets the i-th block's place in `arena`
    where its size and moment are the first capture's; from the first request or return that
    differs on, every request goes to `fallback` (a block handed out before then stays where the
    plan put it, and nothing planned after it is handed out). matched(): every block came from the
    plan and each was let go at the moment its twin was (only then does the layout hold)."""

    def __init__(self, cp, arena, blocks, offsets, fallback):
        self.cp, self.arena, self.blocks, self.offsets, self.fallback = cp, arena, blocks, offsets, fallback
        self.seen, self._tick, self._off_plan = [], 0, False
        self.miss = None                      # where the second capture first went another way

    def _leave(self, why):
        if not self._off_plan:
            self._off_plan, self.miss = True, why

    def malloc(self, size):
        if size == 0:
            return self.fallback(size)
        i = len(self.seen)
        rounded = -(-size // ALIGN) * ALIGN
        if self._off_plan or i >= len(self.blocks) or self.blocks[i][:2] != [rounded, self._tick]:
            # from here on the layout cannot be trusted
            self._leave(f"request {i}: {rounded} B at t={self._tick}, planned "
                        + (f"{self.blocks[i][0]} B at t={self.blocks[i][1]}" if i < len(self.blocks) else "none"))
            return self.fallback(size)
        self.seen.append([rounded, self._tick, None])
        self._tick += 1
        mem = self.cp.cuda.UnownedMemory(self.arena.ptr + self.offsets[i], rounded, _BlockOwner(self, i),
                                         self.arena.device_id)
        return self.cp.cuda.MemoryPointer(mem, 0)

    def freed(self, i):
        if self.blocks[i][2] != self._tick:   # let go at another moment than its twin
            self._leave(f"block {i} ({self.blocks[i][0]} B) let go at t={self._tick}, planned t={self.blocks[i][2]}")
        self.seen[i][2] = self._tick
        self._tick += 1

    def matched(self):
        if not self._off_plan and len(self.seen) < len(self.blocks):
            self._leave(f"{len(self.seen)} of {len(self.blocks)} planned blocks asked for")
        for i, (seen, planned) in enumerate(zip(self.seen, self.blocks)):
            if seen != list(planned):
                self._leave(f"block {i} ({seen[0]} B) alive at the end, planned to be let go at t={planned[2]}")
        return not self._off_plan


class _BlockOwner:
    """Keeps the arena alive for one planned block, and notes when that block is let go."""

    def __init__(self, planned, i):
        self.planned, self.i, self.arena = planned, i, planned.arena

    def __del__(self):
        self.planned.freed(self.i)


def _settings(module):
    """A module's scalar attributes (numbers, strings, booleans and tuples of them), sorted."""
    return tuple(sorted((k, v) for k, v in vars(module).items() if k != "training" and _scalar(v))) + \
        (module.training,)


def _scalar(v):
    return (isinstance(v, (bool, int, float, str)) or
            isinstance(v, tuple) and all(isinstance(e, (bool, int, float, str)) for e in v))


@contextlib.contextmanager
def _prechecked_targets():
    saved, F._targets_prechecked = F._targets_prechecked, True
    try:
        yield
    finally:
        F._targets_prechecked = saved

"""auto: the per-layer, per-pass autotuner (the layer default, ``backend="auto"``).

For each (device, dtype, GEMM precision, geometry, pass) the first call runs backends.tuning's
recipe over every registered backend that ``supports()`` the geometry, on fresh random data of
the pass's shapes: each is checked against ``gemm`` (CHECK_TOL, or cgemm.TF32_TOL with the FFT
backends' GEMM on TF32), timed in interleaved rounds (on the GPU each timed span a burst of INNER
back-to-back calls, as a step queues them), and the winner is cached in memory and on disk
(tuning.remembered), so a second run does not tune again. Choices are per pass: fprop,
bprop and accGrad of one layer may use different backends.

Ties (tuning.select): candidates within margin() of the fastest are tied, and among them the
winner is the FFT backend already chosen for most of the layer's other passes (so a layer stays on
one FFT backend and shares spectra, backends.reuse, which the tuner cannot see: it times each
pass alone), then the first in TIE_ORDER (the backends that share spectra), then the faster,
unless another's host work a call is less by more than the margin's share of the time (tuning.tune's
host): a tie among backends that share nothing goes to the one whose time depends least on the
host's speed. The tied candidates are timed again
before that rule decides (tuning.tune), so that one slow round does not hand a pass to a slower
backend.

A cached choice stands while its record timed (or skipped) every candidate of today, each at
today's revision: one made before a backend joined (tiledfft in session 11; cuDNN installed
since), or before a backend's code for that geometry and pass changed speed (a backend module's
optional revision(pass_name, x_shape, w_shape, stride, padding, math), an int, 0 where absent;
math is the GEMM precision, "fp32" or "tf32", whose records are apart), or timed in bursts of
another length (the record's "inner"; records before session 65 timed single calls), or holding a
tie that host work decides without its host times ("host_ms", since session 65), is tuned again.

A candidate whose module offers prepare() (gemm, cudnn, winograd, fbfft, polyphase, tiledfft) is timed
through the call it prepares, after its first (checked) run: what backends.run_pass runs on a layer's
later calls, without the module call's checks and dispatch, which on a 0.07 ms pass are a tenth of its
time.

A candidate that raises or runs out of memory is skipped, with the reason kept in the record.
``MINITORCH_AUTO_MEMORY_MB`` caps the extra GPU memory a candidate may take (CuPy's pool limit
is lowered while it runs, so a big-buffer candidate fails and is skipped).

Backends in OPT_IN are candidates only where the auto_backends setting names them: the place for
a backend whose GPU path is not measured yet, or not within auto's error bound. None is, now.

On the CPU nothing is timed unless ``MINITORCH_AUTO_TUNE=on``: the first backend in
PREFERENCE that supports the geometry is used, which keeps CPU runs deterministic and fast.

Channels-last layers (nhwc_route, for the PyTorch adapter): cuDNN's NHWC plans take the tensors as
they are, and so do gemm's channels-last 1x1 passes; every other backend takes NCHW. Per pass, auto
times the routes its candidates offer (cuDNN's NHWC plans, where cudnn is among them; for a 1x1
kernel without padding, gemm's GEMMs on the pixels; copies to NCHW, auto's NCHW choice and the
result copied back) and caches the fastest; untimed (the CPU's default), the first of them.
"""
from collections import Counter

import numpy as np

from . import cgemm, config, cufft_buffers, gemm, layout, reuse, tuning
from .common import PASSES, geometry, plain_args

# Untimed order (CPU default): cheapest-to-set-up first; cudnn last (GPU arrays only).
PREFERENCE = ("gemm", "cufft", "fbfft", "direct", "polyphase", "winograd", "tiledfft", "cudnn")
OPT_IN = ()   # candidates only where auto_backends names them (the docstring says which belong here)
# Order among candidates tied within the margin: the backends that share spectra across a step's
# passes (backends.reuse), which their timings leave out, first; every other tied candidate by
# time, or by host work where that differs by more than the margin (tuning.select). Up to session 20
# gemm, direct, winograd and tiledfft were listed too, before cudnn ("a tie is the framework's own"):
# that gave ResNet-50's conv28 fprop (512->1024, 1x1 stride 2) to gemm at 2.8 % slower in tuning,
# 7.6 % slower in table3 (0.692 ms against cuDNN's 0.643, H200).
TIE_ORDER = ("fbfft", "cufft", "polyphase")
ROUNDS, REPEAT = tuning.ROUNDS, tuning.REPEAT   # the recipe's timing (backends/tuning.py)
# On the GPU candidates are timed in bursts of INNER back-to-back calls (tuning.timeit's inner), as a step runs
# its passes and as cudnn's plan search times its plans. One call per event pair from an idle GPU charged a
# candidate its host time between launches in full, where a step's queue hides it: ResNet-50's conv47 fprop
# (1x1 stride 2, b128, H200, session 65), gemm's flat form three launches with ~0.13 ms of host work and 0.62 ms
# on the GPU, was timed 0.66-0.85 ms against cudnn's one launch (0.73 GPU-only) at 0.74-0.84, so the choice
# followed how fast the tuning process's host ran (27 tunings, cudnn chosen in 9) and table3 ran it at 0.98x
# cuDNN strict. A record made in other bursts ("inner", 1 where absent) is made again. The bursts cost INNER x
# the timed runs; no candidate is dropped early to save them: one slow round (a clock hiccup) would drop a winner.
# Bursts still hide a candidate's host work only while it stays under its GPU time, and the host's speed varies
# between processes (session 65: ResNet-18's conv7 TF32 bprop, tiledfft 0.149 ms on the GPU with 0.16-0.17 of
# host work a call, cudnn 0.162 with 0.04, tuned 0.162 against 0.163; table3's process ran tiledfft at 0.24,
# 0.71x cuDNN TF32). So among candidates tied within the margin that TIE_ORDER does not decide, the one with the
# least host work a call wins (tuning.tune's host) where it saves more than the margin's share of the time: it
# stays where it was timed when the host is slower.
INNER = 4
MARGIN = config.SETTINGS["auto_margin"].default   # default tie margin, a fraction of the fastest time
CHECK_TOL = 1e-4  # a candidate further than this from gemm (relative) never wins (fp32 GEMM)
_memory = {}      # key -> record, this process's choices (choices(), remembered())
_fast = {}        # (pass, shapes as given, xp, device, precision) -> (key, backend): remembered()


# The settings that bound a candidate's memory and so its speed: its batch chunks (gemm, cufft,
# fbfft and tiledfft, winograd), which Winograd tiles it may use, which cuDNN plans qualify, and the
# cap under which auto itself times them (a candidate over it is skipped). A choice made under other
# values of these is made again (label()). Session 41 (H200, results/nvidia-h200/tuning/
# autotune_s41_call1_cap1024.json): under a 1024 MiB cudnn bound, VGG-16 conv1_2's TF32 bprop (b64)
# took 3.75 ms on cuDNN's best plan, 1.89 under the default 4 GiB, and tiledfft 2.25; auto's
# record, made under 4 GiB and keyed without the bound, kept cudnn.
BOUNDS = ("gemm_workspace_mb", "cufft_workspace_mb", "fbfft_workspace_mb", "winograd_workspace_mb", "winograd_f4",
          "cudnn_workspace_mb", "auto_memory_mb")
_labels = {}   # config.state() -> label(): the settings are read once per change, not per call


def label():
    """The tuning key's backend field: "auto", or "auto[gemm,fbfft]" under a restricted candidate
    set (the auto_backends setting), so a restricted choice never stands in for a full one; then
    each of BOUNDS that differs from its default, "auto{cudnn_workspace_mb=1024}", so a choice made
    under other bounds never stands in either (at the defaults the field is as it was)."""
    state = config.state()
    text = _labels.get(state)
    if text is None:
        wanted = config.get("auto_backends")
        text = "auto" if wanted is None else f"auto[{','.join(wanted)}]"
        values = {name: config.get(name) for name in BOUNDS}
        bounds = [f"{name}={config.show(name, v)}" for name, v in values.items() if v != config.SETTINGS[name].default]
        if bounds:
            text += "{" + ",".join(bounds) + "}"
        _labels[state] = text
    return text


def margin():
    """The tie margin: the auto_margin setting ($MINITORCH_AUTO_MARGIN, a fraction, 0.03 = 3%)."""
    return config.get("auto_margin")


def _geometry_key(x_shape, w_shape, stride, padding):
    g = geometry(x_shape, w_shape, stride, padding)
    return (g.S, g.f, g.fo, g.h, g.w, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw)


def _fast_key(pass_name, x_shape, w_shape, stride, padding, xp):
    """The arguments as given, the device, the GEMM precision and label(): what a layer passes on every
    call, hashed as is. None unless they are common.plain_args (geometry() must check anything
    else), or where the precision setting or one of label()'s is invalid (the full path then
    reports it in its usual order)."""
    if not plain_args(x_shape, w_shape, stride, padding):
        return None
    try:
        mode, text = cgemm.mode(xp), label()
    except ValueError:   # config.ConfigError too: a bad setting
        return None
    device = None if xp is np else xp.cuda.runtime.getDevice()
    return (pass_name, x_shape, w_shape, stride, padding, xp, device, mode, text)


def remembered(registry, pass_name, x_shape, w_shape, stride, padding, xp=np):
    """pick()'s answer if this process already made it for these very arguments, else None.

    The per-call path of every auto layer after its first step: one dict lookup on the
    arguments as given, instead of normalising the geometry and building the tuning key."""
    fast = _fast_key(pass_name, x_shape, w_shape, stride, padding, xp)
    hit = _fast.get(fast) if fast is not None else None
    if hit is None:
        return None
    tuning.enabled("auto_tune", xp)  # rejects a bad MINITORCH_AUTO_TUNE, remembered or not
    key, name = hit
    known = _memory.get(key)   # the record the answer came from, unless _memory was reset since
    if known is None or known.get("choice") != name or name not in registry:
        return None
    return name


def record_of(pass_name, x_shape, w_shape, stride, padding, xp=np):
    """(tuning key, record) that remembered() answers from for these very arguments, else None:
    what a prepared call (backends._Prepared) checks is still the one in memory."""
    fast = _fast_key(pass_name, x_shape, w_shape, stride, padding, xp)
    hit = _fast.get(fast) if fast is not None else None
    record = _memory.get(hit[0]) if hit is not None else None
    return None if record is None else (hit[0], record)


def pick(registry, pass_name, x_shape, w_shape, stride, padding, xp=np):
    """The name of the backend that runs this pass of this geometry."""
    name, key = _pick(registry, pass_name, x_shape, w_shape, stride, padding, xp)
    fast = _fast_key(pass_name, x_shape, w_shape, stride, padding, xp)
    if name is not None and fast is not None:
        _fast[fast] = (key, name)   # remembered() finds it from the arguments next time
    return name


def _pick(registry, pass_name, x_shape, w_shape, stride, padding, xp):
    """(backend name or None, the tuning key of this choice)."""
    tune = tuning.enabled("auto_tune", xp)  # also rejects a bad MINITORCH_AUTO_TUNE, cached or not
    geom = _geometry_key(x_shape, w_shape, stride, padding)
    key = tuning.key(xp, np.float32, geom, pass_name, label())
    known = _memory.get(key)
    if known is not None and known["choice"] in registry:
        return known["choice"], key  # chosen earlier in this process: every later pass of a layer
    named = config.get("auto_backends") or ()
    usable = [n for n in registry if (n not in OPT_IN or n in named) and runs_on(registry[n], xp)
              and registry[n].supports(x_shape, w_shape, stride, padding)]
    candidates = [n for n in PREFERENCE if n in usable] + [n for n in usable if n not in PREFERENCE]
    if not candidates:
        return None, key
    if len(candidates) == 1 or not tune:
        _memory[key] = {"choice": candidates[0], "ms": {}, "skipped": {}, "why": "untimed"}
        return candidates[0], key
    siblings = _siblings(xp, geom, pass_name)
    revisions = _revisions(registry, candidates, pass_name, x_shape, w_shape, stride, padding, cgemm.mode(xp))

    def tuned():
        record = _tune(registry, candidates, pass_name, x_shape, w_shape, stride, padding, xp, siblings)
        if revisions:
            record["revisions"] = revisions
        if _inner(xp) > 1:
            record["inner"] = _inner(xp)
        return record

    record = tuning.remembered(key, tuned, valid=lambda choice: choice in candidates)
    if record["choice"] not in candidates or not _compared(record, candidates, revisions, _inner(xp)):
        # remembered in this process for another registry, or made before a candidate it never
        # timed joined (a new backend, cuDNN installed since), before a candidate's code changed,
        # or timed in other bursts: tuned again over today's candidates
        record = tuned()
        tuning.default_cache().put(key, record)
    _memory[key] = record
    return record["choice"], key


def _revisions(registry, candidates, pass_name, x_shape, w_shape, stride, padding, math, pass_names=None):
    """{name: revision} of the candidates whose revision() for this pass (pass_names[name] where
    given: a route's form of it), geometry and GEMM precision is not 0."""
    out = {}
    for name in candidates:
        revision = getattr(registry[name], "__dict__", {}).get("revision")   # its own, if any (a
        # test's stand-in answers every attribute through __getattr__)
        asked = pass_names[name] if pass_names else pass_name
        r = revision(asked, x_shape, w_shape, stride, padding, math) if callable(revision) else 0
        if r:
            out[name] = r
    return out


def _inner(xp):
    """The calls a timed span of the recipe holds on xp's arrays: INNER on the GPU; one on the CPU, where
    nothing queues and a call's time is its host time."""
    return 1 if xp is np else INNER


def _compared(record, candidates, revisions, inner=1):
    """Whether a tuned record timed or skipped every one of `candidates`, each at `revisions`, in
    bursts of `inner` calls, and was decided by today's rule: a choice that shares no spectra must be
    what select() makes of the record's own times (and host times) today, so a tie handed to it
    by the order of before session 20 is tuned again, and so is one the host rule would decide
    otherwise (a record keeps the rounded values its choice was made on: tuning.tune)."""
    if record.get("inner", 1) != inner or _host_undecided(record):
        return False
    made_at = record.get("revisions") or {}
    if not isinstance(made_at, dict):   # a hand-edited record: at revisions unknown, so tuned again
        return False
    seen = {n: r for n, r in made_at.items() if n in candidates}
    ms = record.get("ms") or {}
    choice = record.get("choice")
    stale_tie = (choice not in TIE_ORDER and choice in ms
                 and select(ms, None, margin(), host=record.get("host_ms"))[0] != choice)
    return (set(candidates) <= set(ms) | set(record.get("skipped") or ()) and seen == revisions
            and not stale_tie)


def _host_undecided(record):
    """Whether a record made without host times (no "host_ms": before session 65's tie rule) holds a tie the
    host work a call decides today: two or more candidates within the margin of the fastest, none of them in
    TIE_ORDER (which would decide first). Only such records are tuned again for it: elsewhere the rule cannot
    change the choice."""
    ms = record.get("ms") or {}
    if "host_ms" in record or len(ms) < 2:
        return False
    tied = tuning._tied(ms, margin())
    return len(tied) > 1 and not any(name in TIE_ORDER for name in tied)


def runs_on(backend, xp):
    """Whether `backend` takes arrays of `xp`: its DEVICES tuple ("cpu", "cuda"), both where it
    declares none (cudnn runs on CuPy arrays only; a test's stand-in may answer any attribute)."""
    devices = getattr(backend, "DEVICES", None)
    return not isinstance(devices, tuple) or ("cpu" if xp is np else "cuda") in devices


def _siblings(xp, geom, pass_name):
    """{pass: backend} already chosen for this layer geometry's other passes (here or on disk)."""
    chosen = {}
    for other in PASSES:
        if other != pass_name:
            k = tuning.key(xp, np.float32, geom, other, label())
            record = _memory.get(k) or tuning.default_cache().get(k)
            if tuning.is_record(record) and isinstance(record["choice"], str):
                chosen[other] = record["choice"]
    return chosen


def select(times, siblings=None, tie_margin=MARGIN, host=None):
    """(winner, why) from times {backend: ms} (and host times, as tune records them) by tuning.select's
    rule with auto's preference."""
    return tuning.select(times, tie_margin, *_tie_rule(siblings), host=host)


def _tie_rule(siblings):
    """(prefer, explain) for tuning.select: among tied backends that share spectra (TIE_ORDER), the
    one chosen for most of the layer's other passes (siblings, {pass: backend}), then the first in
    TIE_ORDER; the others after them, by time or host work (tuning.select's last keys)."""
    siblings = siblings or {}
    votes = Counter(name for name in siblings.values() if name in TIE_ORDER)
    rank = {name: i for i, name in enumerate(TIE_ORDER)}

    def prefer(name):
        return (-votes[name], rank.get(name, len(TIE_ORDER)))

    def explain(name):
        if votes[name]:
            return f"the layer's {', '.join(p for p in PASSES if siblings.get(p) == name)} backend"
        return f"tie order {', '.join(TIE_ORDER)}"
    return prefer, explain


def _pass_inputs(xp, pass_name, x_shape, w_shape, stride, padding):
    """Fresh random float32 arguments of one pass (never zeros: they hide bugs and time differently)."""
    g = geometry(x_shape, w_shape, stride, padding)
    if xp is np:
        rand = np.random.default_rng().standard_normal
    else:
        rand = xp.random.standard_normal
    gy_shape = (g.S, g.fo, g.oh, g.ow)
    if pass_name == "fprop":
        return (rand(x_shape, dtype=np.float32), rand(w_shape, dtype=np.float32))
    if pass_name == "bprop":
        return (rand(gy_shape, dtype=np.float32), rand(w_shape, dtype=np.float32), tuple(x_shape))
    return (rand(gy_shape, dtype=np.float32), rand(x_shape, dtype=np.float32), tuple(w_shape))


def _tune(registry, candidates, pass_name, x_shape, w_shape, stride, padding, xp, siblings=None):
    """tuning.tune over the candidates, checked against gemm, with auto's tie preference."""
    args = _pass_inputs(xp, pass_name, x_shape, w_shape, stride, padding)
    cap_mb = config.get("auto_memory_mb")
    prepared = {}   # name -> its prepared call (backends._Prepared), made after its first run

    def run(name):
        try:
            ready = prepared.get(name)
            if ready is not None:
                return ready(*args[:2])
            backend = registry[name]
            out = getattr(backend, pass_name)(*args, stride=stride, padding=padding)
            prepare = getattr(backend, "prepare", None)
            if prepare is not None and xp is not np:
                # Timed as a layer's later calls will run it: on a 0.07 ms pass the module call's
                # own checks are a tenth of the time (ResNet-18's stride-2 1x1 fprops on an H200:
                # gemm's fused form 0.062 ms on the GPU against cuDNN's 0.067, yet timed slower)
                g = geometry(x_shape, w_shape, stride, padding)
                prepared[name] = prepare(pass_name, g, xp) or (
                    lambda a, b: getattr(backend, pass_name)(a, b, *args[2:], stride=stride, padding=padding))
            return out
        except Exception:
            _free_pool(xp)         # a failed candidate's blocks must not squeeze the next one
            raise

    # gemm checks every candidate, also where the candidate set leaves it out.
    reference = getattr(registry.get("gemm", gemm), pass_name)(*args, stride=stride, padding=padding)
    tol = cgemm.TF32_TOL if cgemm.mode(xp) == "tf32" else CHECK_TOL
    prefer, explain = _tie_rule(siblings)
    try:
        # The cap holds for the whole tuning, set once: outside the timed runs' event brackets.
        with _memory_cap(xp, cap_mb):
            return tuning.tune(candidates, run, xp, reference=reference, reference_name="gemm", tol=tol,
                               margin=margin(), prefer=prefer, explain=explain, inner=_inner(xp),
                               host=True)
    except RuntimeError as e:
        raise RuntimeError(f"auto: every backend failed for {pass_name} of input {tuple(x_shape)}, "
                           f"weight {tuple(w_shape)}: {e}") from None
    finally:
        # cufft's scratch buffers and plans persist between calls (cufft_buffers): timing cufft
        # grows them to this layer's size, and they stayed allocated whichever backend won
        # (converted ResNet-50 b128 in PyTorch, session 13: a step's peak 13390 MiB in the process
        # that had tuned, 10992 in one that had not; stock 10966). A cufft layer regrows its own.
        cufft_buffers.release_buffers()


class _memory_cap:
    """Lower CuPy's pool limit to (in use + cap) while the candidates run; a no-op without a cap."""

    def __init__(self, xp, cap_mb):
        self.xp, self.cap = xp, None if cap_mb is None or xp is np else float(cap_mb) * 2**20

    def __enter__(self):
        if self.cap is not None:
            pool = self.xp.get_default_memory_pool()
            self.old = pool.get_limit()
            pool.set_limit(size=int(pool.used_bytes() + self.cap))

    def __exit__(self, *exc):
        if self.cap is not None:
            self.xp.get_default_memory_pool().set_limit(size=self.old)


def _free_pool(xp):
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()


def choices():
    """This process's choices: a list of JSON-able dicts, one per (geometry, pass): device, dtype,
    math, geometry, pass, backend, ms, skipped, why."""
    rows = []
    for (device, dtype, math, geom, pass_name, _), rec in _memory.items():
        rows.append({"device": device, "dtype": dtype, "math": math, "geometry": list(geom), "pass": pass_name,
                     "backend": rec["choice"], "ms": rec["ms"], "skipped": rec["skipped"], "why": rec["why"]})
    return rows


def format_choices():
    """A plain-text table of choices: one line per layer geometry and pass (a tie won on the
    margin rule says so after the times)."""
    lines = [f"{'input (S,f,h,w)':<22}{'weight (fo,f,kh,kw)':<22}{'stride':<8}{'pad':<8}{'pass':<9}"
             f"{'gemm':<6}{'backend':<8} ms per candidate"]
    for r in choices():
        S, f, fo, h, w, kh, kw, sh, sw, ph, pw = r["geometry"]
        ms = ", ".join(f"{k} {v:.3f}" for k, v in sorted(r["ms"].items(), key=lambda kv: kv[1])) or "(untimed)"
        why = f" ({r['why']})" if r["why"] not in ("fastest", "untimed", "only candidate") else ""
        lines.append(f"{str((S, f, h, w)):<22}{str((fo, f, kh, kw)):<22}{str((sh, sw)):<8}{str((ph, pw)):<8}"
                     f"{r['pass']:<9}{r['math']:<6}{r['backend']:<8} {ms}{why}")
    return "\n".join(lines)


# -- channels-last layers: cuDNN's NHWC plans, a 1x1 layer's GEMMs, or our NCHW passes on copies ------

ROUTES = ("cudnn", "gemm", "nchw")   # in tie order: cuDNN's plans take the tensors as they are, the GEMMs do at
                                     # stride 1 (strided: a gather, or a scatter into zeros), "nchw" copies both ways
# The route records' backend field for the route sets that had one before session 47 (those records keep theirs);
# any other set is named in full, "auto:nhwc=gemm+nchw" (cuDNN not installed, or not among the candidates)
_ROUTE_LABELS = {("cudnn", "nchw"): ":nhwc", ("cudnn", "gemm", "nchw"): ":nhwc+gemm"}
# The routes' revisions (_route_revisions) of the records made before records carried them (session 46): a
# record without "revisions" was made at these
_UNRECORDED_REVISIONS = {"cudnn": 2, "gemm": 1}


def routes_for(registry, x_shape, w_shape, stride, padding, xp):
    """The routes a channels-last layer's passes can take with auto's candidates `registry` on `xp`'s
    arrays, in ROUTES' order: "cudnn" where cudnn is among them, runs on xp and supports the
    geometry; "gemm" (gemm.fprop_nhwc and the others: GEMMs on the arrays as they are) for a 1x1
    kernel without padding where gemm is among them; "nchw" always."""
    cudnn = registry.get("cudnn")
    routes = ("cudnn",) if cudnn is not None and runs_on(cudnn, xp) and cudnn.supports(
        x_shape, w_shape, stride, padding) else ()
    if "gemm" in registry and gemm.nhwc_supports(x_shape, w_shape, stride, padding):
        routes += ("gemm",)
    return routes + ("nchw",)


def _route_label(routes, bound=None):
    """The route record's backend field: label() + ":nhwc" (cuDNN's plans or copies), ":nhwc+gemm"
    (the "gemm" route too: it joined in session 46, so a 1x1 layer's record made without it is timed
    again), else the routes named (":nhwc=gemm+nchw"); then "{nhwc_route_mb=N}" where that bound
    (bytes) is set, so a choice weighed under one bound, or none, never stands in for another's."""
    text = label() + _ROUTE_LABELS.get(routes, ":nhwc=" + "+".join(routes))
    return text if bound is None else text + "{nhwc_route_mb=" + config.show("nhwc_route_mb", bound / 2**20) + "}"


_route_bounds = {}   # config.state() -> the nhwc_route_mb setting in bytes (None: unset), read once per change


def _route_bound():
    try:
        return _route_bounds[config.state()]
    except KeyError:
        mib = config.get("nhwc_route_mb")
        bound = _route_bounds[config.state()] = None if mib is None else mib * 2**20
        return bound


def _weighed(record, bound):
    """The route record with its choice weighed: where `bound` (bytes) is set and the record has
    the routes' peaks ("bytes"), the timed choice if its peak is at most `bound` above the leanest
    route's, else the tie rule's pick (the margin, ROUTES' order) among the routes within it;
    otherwise as timed. A choice set aside says so in "why", its own reason kept."""
    peaks = record.get("bytes") or {}
    if bound is None or record["choice"] not in peaks:
        return record
    lean = min(peaks.values())
    if peaks[record["choice"]] <= lean + bound:
        return record
    fits = {r: record["ms"][r] for r in peaks if peaks[r] <= lean + bound and r in record["ms"]}
    choice, why = tuning.select(fits, margin(), prefer=ROUTES.index,
                                explain=lambda route: "tie order: no layout copies first")
    mib = lambda r: f"{peaks[r] / 2**20:.0f} MiB"   # noqa: E731
    return {**record, "choice": choice,
            "why": f"{why} of the routes within nhwc_route_mb of the leanest ({lean / 2**20:.0f} MiB); "
                   f"{record['choice']} ({record['why']}) held {mib(record['choice'])}, {choice} {mib(choice)}"}


def _route_revisions(registry, routes, pass_name, x_shape, w_shape, stride, padding, math):
    """{route: revision} of the routes that run a backend's own pass on the arrays as they are: cudnn's
    revision() of the pass, gemm's of its channels-last form (gemm.revision of "<pass>_nhwc"). A record
    made at other revisions is timed again, as auto's NCHW choices are (_revisions); the "nchw" route's
    own choice is auto's, with its own record."""
    forms = {"cudnn": pass_name, "gemm": f"{pass_name}_nhwc"}
    return _revisions(registry, [r for r in routes if r in forms], None, x_shape, w_shape, stride, padding, math,
                      pass_names=forms)


_routes = {}          # _fast_key of ("nhwc", pass) -> route: the per-call path
_route_records = {}   # tuning key -> record, this process's route choices (route_choices())


def nhwc_route(registry, run_nchw, pass_name, x_shape, w_shape, stride, padding, xp, measure=None):
    """How auto runs `pass_name` of a channels-last layer (operands and result laid out NHWC) on
    `xp`'s arrays: "cudnn", cuDNN's NHWC plans on the arrays as they are (GPU); "gemm" (a 1x1 kernel
    without padding: routes_for), one GEMM on the arrays as they are (gemm.fprop_nhwc, bprop_nhwc,
    accgrad_nhwc); or "nchw", the operands copied to NCHW, the pass run as auto runs NCHW passes
    (run_nchw: backends.run_pass) and its result copied back to NHWC. The routes are those of
    routes_for: where "nchw" is the only one, it is the answer.

    The first call per device, geometry, pass, precision and label() times the routes, copies
    included, on fresh channels-last data by the tuning recipe, each checked against gemm as auto's
    candidates are, and caches the record beside auto's own choices (backend field _route_label():
    label() + ":nhwc", ":nhwc+gemm", or the routes named where cuDNN is not among them), with the
    routes' revisions (_route_revisions: a record made at others is timed again); a tie within
    margin() goes to the earlier of ROUTES. Tuning off (MINITORCH_AUTO_TUNE; the CPU's default): the
    first route, untimed. A record stands while it is in the cache at today's revisions, also after
    auto's NCHW choice under it is tuned again (the "nchw" route's revision is none: delete the cache
    to time the routes anew after that). Timed alone, each route pays its own copies: in a layer's
    backward the adapter copies gradOutput once for both NCHW passes, so the "nchw" route's times are
    upper bounds there. Not timed: the adapter's own host work around a pass (one scope entry a
    crossing, the route look-up, the result's crossing to a tensor), which every route pays alike, and
    the copies' memory (no auto_memory_mb cap here; see Memory below). The "cudnn" route is timed through the module
    call, as the adapter makes it.

    Memory: `measure` (the PyTorch adapter's, on the GPU: a context manager counting what CuPy
    allocates inside it, `peak` and `live` after it) counts each route's second run, the timing's
    warm-up, a call as a layer's later ones (its copies, workspaces, spectra and result), plus what
    the first run left held besides its result (the first run, the check's, may tune: cuDNN's plan
    search, auto's NCHW choice), in the record's "bytes". Where the nhwc_route_mb setting is set,
    a route whose peak is more than that above the leanest route's does not win: of the others,
    the one the tie rule picks does (_weighed; the record, keyed by the bound, says why). Unset (the
    default), the fastest wins and its memory is not weighed: VGG-16's channels-last TF32 step
    (b64) then took three accGrads to the "nchw" route, 0.22-0.26 ms faster each than cuDNN's NHWC
    plan, and its peak was 5589 MiB against the stock model's 5057 under reduce-overhead (session
    59). The count sees every thread's allocations while it runs (the adapter's count is one for
    the process): another thread allocating meanwhile inflates it. Within a process the first choice
    for a geometry and pass stands (the fast path, _routes): a caller that counts after one that did
    not (the adapter always counts on the GPU) is not weighed again until the next process."""
    bound = _route_bound()
    fast = _fast_key(f"nhwc:{pass_name}", x_shape, w_shape, stride, padding, xp)
    fast = fast and fast + (bound,)
    route = _routes.get(fast) if fast is not None else None
    if route is not None:
        return route
    routes = routes_for(registry, x_shape, w_shape, stride, padding, xp)
    if len(routes) == 1:
        if fast is not None:
            _routes[fast] = routes[0]
        return routes[0]
    if not tuning.enabled("auto_tune", xp):
        return routes[0]
    key = tuning.key(xp, np.float32, _geometry_key(x_shape, w_shape, stride, padding), pass_name,
                     _route_label(routes, bound))
    record = _route_records.get(key)
    if record is None:
        revisions = _route_revisions(registry, routes, pass_name, x_shape, w_shape, stride, padding, cgemm.mode(xp))

        def tuned():
            with reuse.suspended():   # a timed route pays for its own FFTs, every repeat
                record = _tune_route(registry.get("cudnn"), run_nchw, routes, pass_name, x_shape, w_shape, stride,
                                     padding, xp, measure)
            record["revisions"] = revisions
            if _inner(xp) > 1:
                record["inner"] = _inner(xp)
            return _weighed(record, bound)

        record = tuning.remembered(key, tuned, valid=lambda choice: choice in routes)
        made_at = record.get("revisions", {r: v for r, v in _UNRECORDED_REVISIONS.items() if r in revisions})
        # timed again where a route's pass changed since the record was made, or where a bound is to
        # weigh what a record made without a count (the CPU's, another caller's) has not measured
        unweighed = bound is not None and measure is not None and "bytes" not in record
        if made_at != revisions or unweighed or record.get("inner", 1) != _inner(xp):
            record = tuned()
            tuning.default_cache().put(key, record)
        _route_records[key] = record
    if fast is not None:
        _routes[fast] = record["choice"]
    return record["choice"]


def _tune_route(cudnn, run_nchw, routes, pass_name, x_shape, w_shape, stride, padding, xp, measure=None):
    """tuning.tune over `routes` (routes_for) for one pass, each checked against gemm on the NCHW data
    (without a bias: the "gemm" and "nchw" routes add a layer's bias after fprop, cuDNN's may fuse it;
    not timed). cudnn: the backend, where "cudnn" is among the routes. measure: see nhwc_route; the
    record's "bytes" {route: peak bytes} where given: each route's second run (the timing's warm-up)
    counted, plus what its first run (the check's, which may tune) left held besides its result."""
    nchw = _pass_inputs(xp, pass_name, x_shape, w_shape, stride, padding)
    a, b = (layout.to_nhwc(t) for t in nchw[:2])   # the same values, laid out as a channels-last layer's
    third = nchw[2:]
    reference = getattr(gemm, pass_name)(*nchw, stride=stride, padding=padding)
    del nchw

    def plain(route):
        if route == "cudnn":
            return getattr(cudnn, pass_name)(a, b, *third, stride=stride, padding=padding, layout="nhwc")
        if route == "gemm":
            return getattr(gemm, f"{pass_name}_nhwc")(a, b, *third, stride=stride, padding=padding)
        out = run_nchw("auto", pass_name, layout.to_nchw(a), layout.to_nchw(b), *third,
                       x_shape=x_shape, w_shape=w_shape, stride=stride, padding=padding, later=())
        return layout.to_nhwc(out)   # the adapter's copies, the same kernels (backends/layout.py)

    calls, kept, peaks = {}, {}, {}

    def run(route):
        n = calls[route] = calls.get(route, 0) + 1
        if measure is None or n > 2:
            return plain(route)
        with measure() as counted:
            out = plain(route)
        if n == 1:   # the check's run, also the route's first call: it may tune (cuDNN's plan search, auto's NCHW
            kept[route] = max(0, counted.live - out.nbytes)   # choice), so only what it keeps is counted
        else:        # the timing's warm-up: a call as a layer's later ones, its result counted as theirs would be
            peaks[route] = counted.peak + kept[route]
        return out

    tol = cgemm.TF32_TOL if cgemm.mode(xp) == "tf32" else CHECK_TOL
    try:
        record = tuning.tune(routes, run, xp, reference=reference, reference_name="gemm", tol=tol,
                             margin=margin(), prefer=ROUTES.index, inner=_inner(xp),
                             explain=lambda route: "tie order: no layout copies first")
        if peaks:
            record["bytes"] = {r: int(peaks[r]) for r in record["ms"] if r in peaks}
        return record
    except RuntimeError as e:
        raise RuntimeError(f"auto: no route ({', '.join(routes)}) ran {pass_name} of channels-last input "
                           f"{tuple(x_shape)}, weight {tuple(w_shape)}: {e}") from None
    finally:
        cufft_buffers.release_buffers()   # as _tune: a timed cufft pass's buffers are not kept


def route_choices():
    """This process's channels-last route choices, as choices() gives auto's: JSON-able dicts."""
    rows = []
    for (device, dtype, math, geom, pass_name, _), rec in _route_records.items():
        rows.append({"device": device, "dtype": dtype, "math": math, "geometry": list(geom), "pass": pass_name,
                     "route": rec["choice"], "ms": rec["ms"], "bytes": rec.get("bytes", {}), "skipped": rec["skipped"],
                     "why": rec["why"]})
    return rows

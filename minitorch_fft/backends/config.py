"""Settings: every MINITORCH_* environment variable, declared once, read in one place.

Each setting has a name (used in code), an environment variable, a type with its allowed
range, a default and one line of doc (SETTINGS below; `python -m minitorch_fft.backends` prints the
table the README shows). Code reads a setting with `config.get("gemm_workspace_mb")`; nothing
else in the project reads os.environ.

Values come from, in this order:
  1. `with config.override(name=value, ...):` blocks (innermost first), for code and tests;
  2. `config.set(name, value)`, for the rest of the process (cgemm.set_tf32 is one);
  3. the environment variable, parsed and checked when first read (a bad value raises
     ConfigError naming the variable and what it allows; train.py turns that into exit 2);
  4. the default.
Each variable is read from the environment once, at its first use, and remembered (a setting is
read on every pass, and os.environ costs a microsecond or two a look-up); `reload()` forgets what
was read, for code that changes os.environ after the fact. Nothing is read at import, so a bad
value never breaks `import minitorch_fft`. Overrides are process-wide, not per thread.

`snapshot()` is the tuple of every setting that changes what a pass computes or launches: the
CUDA-graph key (minitorch_fft.graphs) is built from it, so a graph is never replayed under other
settings. The tuning-cache key (backends.tuning.key) takes the one setting that changes what a
choice means, the GEMM precision (tf32). auto's choices are keyed by the settings that bound a
candidate's memory too, where they differ from their defaults (backends.auto.BOUNDS): a choice
made under a 4 GiB cuDNN workspace is not taken under 1 GiB. Of a backend's own choices, cudnn's
plan and winograd's groups are keyed by their bound; gemm's forms and the FFT backends' bases are
tuned under their bound's batch chunks but keyed without it, and reused as they are, as is a
choice tuned under other tuning modes.
"""
import contextlib
import difflib
import functools
import math
import os
import re
from collections import namedtuple


class ConfigError(ValueError):
    """A setting with a value outside what it allows (names the variable and the limit)."""


Setting = namedtuple("Setting", "name env kind default doc keyed")
# kind: "bool" (0 or 1), "tune" (auto, on or off), "mib" (a size in MiB, > 0 and finite),
# "fraction" ([0, 1)), "count" (an int >= 0), "positive" (an int >= 1), "path", "text", "names" (backend
# names, comma-separated, kept as a tuple; which names exist is checked where the registry is,
# backends.auto_registry). keyed: part of snapshot().

SETTINGS = {s.name: s for s in (
    Setting("tf32", "MINITORCH_CGEMM_TF32", "bool", False,
            "TF32 (1) or strict fp32 (0): the FFT and Winograd backends' GEMMs and cudnn's convolutions", True),
    Setting("gemm_workspace_mb", "MINITORCH_GEMM_WORKSPACE_MB", "mib", 512.0,
            "gemm's im2col workspace; larger batches run in chunks", True),
    Setting("cufft_workspace_mb", "MINITORCH_CUFFT_WORKSPACE_MB", "mib", 2048.0,
            "cufft's frequency-domain buffers; larger batches run in chunks", True),
    Setting("fbfft_workspace_mb", "MINITORCH_FBFFT_WORKSPACE_MB", "mib", 2048.0,
            "fbfft's frequency-domain buffers; larger batches run in chunks", True),
    Setting("reuse_weight_spectra", "MINITORCH_REUSE_WEIGHT_SPECTRA", "bool", False,
            "inside reuse_spectra(), fprop keeps each weight's spectrum for bprop (1: faster, more memory)", True),
    Setting("winograd_workspace_mb", "MINITORCH_WINOGRAD_WORKSPACE_MB", "mib", 2048.0,
            "winograd's transformed tiles at most (and 2x their operands, bprop's 1x); larger batches in chunks",
            True),
    Setting("winograd_f4", "MINITORCH_WINOGRAD_F4", "bool", True,
            "winograd may use F(4x4,3x3) in strict fp32 (1; within 8e-6 of float64 on the zoo's layers; "
            "TF32 mode runs F(2x2) alone), or F(2x2,3x3) only (0)",
            True),
    Setting("cudnn_workspace_mb", "MINITORCH_CUDNN_WORKSPACE_MB", "mib", 4096.0,
            "cudnn's workspace: cuDNN plans needing more are not used", True),
    Setting("pass_graphs", "MINITORCH_PASS_GRAPHS", "bool", False,
            "the PyTorch adapter replays a layer's passes as one CUDA graph once their addresses repeat "
            "(1: less host time, an arena of their temporaries held)", False),
    Setting("pass_graph_mb", "MINITORCH_PASS_GRAPH_MB", "mib", None,
            "pass graphs: a layer's passes are captured only where their eager calls' temporaries peak at most "
            "this, the others run eagerly (unset: every layer's); the arena held is the largest layer's under the "
            "bound", False),
    Setting("auto_tune", "MINITORCH_AUTO_TUNE", "tune", "auto",
            "auto times the backends: auto = on the GPU only, on, off (first supported backend)", True),
    Setting("auto_margin", "MINITORCH_AUTO_MARGIN", "fraction", 0.03,
            "auto's tie margin: candidates within it of the fastest are tied", True),
    Setting("auto_backends", "MINITORCH_AUTO_BACKENDS", "names", None,
            "the backends auto may choose from: names, comma-separated, or ours (all but cuDNN); "
            "unset: every registered backend", True),
    Setting("auto_memory_mb", "MINITORCH_AUTO_MEMORY_MB", "mib", None,
            "extra GPU memory a candidate may take while auto times it (unset: no cap)", False),
    Setting("nhwc_route_mb", "MINITORCH_NHWC_ROUTE_MB", "mib", None,
            "auto's channels-last routes in the PyTorch adapter: a route whose temporaries peak more than this "
            "above the leanest route's does not win (unset: the fastest wins, its memory not weighed)", True),
    Setting("gemm_tune", "MINITORCH_GEMM_TUNE", "tune", "auto",
            "gemm tunes its forms (per-image GEMMs, one over the batch, accGrad's implicit and rows kernels): "
            "auto = on the GPU only, on, off",
            True),
    Setting("cufft_tune", "MINITORCH_CUFFT_TUNE", "tune", "auto",
            "cufft tunes its basis, GEMM form and layout: auto = on the GPU only, on, off", True),
    Setting("direct_tune", "MINITORCH_DIRECT_TUNE", "tune", "auto",
            "direct tunes its kernel configuration: auto = on the GPU only, on, off", True),
    Setting("winograd_tune", "MINITORCH_WINOGRAD_TUNE", "tune", "auto",
            "winograd tunes its tile size where winograd_f4 allows two, and accGrad's images a group: "
            "auto = on the GPU only, on, off", True),
    Setting("tiledfft_tune", "MINITORCH_TILEDFFT_TUNE", "tune", "auto",
            "tiledfft tunes its tile size (8, 16 or 32): auto = on the GPU only, on, off", True),
    Setting("cudnn_tune", "MINITORCH_CUDNN_TUNE", "tune", "auto",
            "cudnn times cuDNN's plans: auto = on the GPU only, on, off (cuDNN's first plan)", True),
    Setting("tune_cache", "MINITORCH_TUNE_CACHE", "path", None,
            "the tuning cache file (unset: ~/.cache/minitorch_fft/autotune.json)", False),
    Setting("direct_poison", "MINITORCH_DIRECT_POISON", "bool", False,
            "direct fills its outputs with NaN before each launch (tests: unwritten elements show)", True),
    Setting("fbfft_check", "MINITORCH_FBFFT_CHECK", "bool", False,
            "fbfft synchronises and checks the device after every kernel launch (debugging)", False),
    Setting("debug", "MINITORCH_DEBUG", "bool", False,
            "train.py prints the full traceback of an error instead of one line", False),
    Setting("commit", "MINITORCH_COMMIT", "text", None,
            "the commit benchmark results name where the tree has no .git", False),
    # Data-parallel training (minitorch_fft.distributed): the variables torchrun sets, and
    # train.py --gpus sets for the processes it starts. WORLD_SIZE set means "this is one rank".
    Setting("rank", "RANK", "count", None, "data-parallel: this process's rank, 0 .. WORLD_SIZE-1", False),
    Setting("world_size", "WORLD_SIZE", "positive", None,
            "data-parallel: the number of processes (one per GPU); unset: not a data-parallel rank", False),
    Setting("local_rank", "LOCAL_RANK", "count", None,
            "data-parallel: this process's GPU on its host (unset: RANK)", False),
    Setting("master_addr", "MASTER_ADDR", "text", None,
            "data-parallel: rank 0's host, where it hands out the NCCL id", False),
    Setting("master_port", "MASTER_PORT", "positive", None, "data-parallel: rank 0's TCP port there", False),
)}

_overrides = []   # a stack of {name: value}, innermost last
_process = {}     # set(): values for the rest of the process, below any override block
_environment = {}  # name -> the value its variable gave when first read (reload() empties it)
_epoch = [0]       # reload()s so far: a reload may change what the environment gives
_states = {}       # the sources' content (state()) -> its number
_state = [0]       # the number of the sources' content now
# torchrun's variables keep torchrun's names (every other setting's variable is MINITORCH_*).
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
ENVIRONMENT = object()   # override(name=ENVIRONMENT): the block follows the environment variable


def get(name):
    """The value of setting `name` now (see the module docstring for the order)."""
    for layer in reversed(_overrides):
        if name in layer:
            value = layer[name]
            if value is ENVIRONMENT:
                break
            return value
    else:
        if name in _process:
            return _process[name]
    try:
        return _environment[name]
    except KeyError:
        pass
    setting = _setting(name)
    raw = os.environ.get(setting.env)
    value = setting.default if raw is None else _parse(setting.name, raw)   # raises on a bad value
    _environment[name] = value
    return value


def reload():
    """Forget what was read from the environment: the next get() of each setting reads it again."""
    _environment.clear()
    _epoch[0] += 1
    _restate()


def state():
    """A number that is equal at two moments only if every setting had the same value at both (the
    same override blocks, set() values and environment reads): what caches of decisions the
    settings make key on, instead of reading each setting (backends.run_pass's prepared calls).
    Equal contents get equal numbers, so a block entered on every step finds the last step's
    entries. It is worked out when the sources change, not when asked."""
    return _state[0]


def _restate():
    content = (tuple(tuple(layer.items()) for layer in _overrides), tuple(sorted(_process.items())), _epoch[0])
    _state[0] = _states.setdefault(content, len(_states))


_restate()   # the start-up content is number 0: the first block entered gets a number of its own (session 41:
# unregistered, the first override's content took 0 too, and caches keyed by state() answered it with the
# start-up's entries: auto.label() said "auto" inside the first cudnn_workspace_mb block of a process)


def mib_bytes(name):
    """A MiB-sized setting in bytes (an int)."""
    return int(get(name) * 2**20)


@contextlib.contextmanager
def override(**values):
    """`with config.override(gemm_workspace_mb=64):` sets settings for the block, checked as the
    environment would be, and restores them when it ends (also on an exception)."""
    layer = {name: _check(_setting(name), value) for name, value in values.items()}
    _overrides.append(layer)
    _restate()
    try:
        yield
    finally:
        _overrides.remove(layer)
        _restate()


def set(name, value):  # noqa: A001 - config.set reads as intended
    """Set `name` for the rest of the process (below override blocks); None returns it to the
    environment."""
    setting = _setting(name)
    if value is None:
        _process.pop(name, None)
    else:
        _process[name] = _check(setting, value)
    _restate()


def changed():
    """{variable: value} of every setting whose value now differs from its default, the commit
    aside (a result's provenance: what it was measured under; benchmarks.harness). A bad value is
    given as its error, not raised: a run that never read it is not lost over it at the end."""
    out = {}
    for s in SETTINGS.values():
        if s.name == "commit":
            continue
        try:
            value = get(s.name)
        except ConfigError as e:
            out[s.env] = f"invalid: {e}"
            continue
        if value != s.default:
            out[s.env] = list(value) if isinstance(value, tuple) else value
    return out


def snapshot():
    """((name, value), ...) of every keyed setting: what the graph and tuning keys are built from."""
    return tuple((s.name, get(s.name)) for s in SETTINGS.values() if s.keyed)


def environment_with(**variables):
    """A copy of this process's environment with `variables` (name=str) set: the environment of a
    process this one starts (train.py --gpus)."""
    return {**os.environ, **{k: str(v) for k, v in variables.items()}}


def check():
    """Read every setting once, so that a bad environment fails before any work (train.py)."""
    for name in SETTINGS:
        get(name)


def unknown_variables(environ=None):
    """[(name, the declared variable it is closest to, or None)] for each MINITORCH_* variable in
    `environ` (default: this process's environment) that names no setting: a misspelling
    (MINITORCH_CGEM_TF32) would otherwise be ignored without a word. train.py refuses them."""
    declared = [s.env for s in SETTINGS.values()]
    env = os.environ if environ is None else environ
    return [(name, next(iter(difflib.get_close_matches(name, declared, n=1)), None))
            for name in sorted(env) if name.startswith("MINITORCH_") and name not in declared]


def table():
    """The settings as a Markdown table (the README's)."""
    rows = ["| variable | values | default | what it does |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        default = "unset" if s.default is None else show(s.name, s.default)
        rows.append(f"| `{s.env}` | {_ALLOWED[s.kind]} | {default} | {s.doc} |")
    return "\n".join(rows)


# -- parsing and checking ------------------------------------------------------------------------

_ALLOWED = {"bool": "0 or 1", "tune": "auto, on or off", "mib": "MiB > 0",
            "fraction": "0 <= x < 1", "count": "an integer >= 0",
            "positive": "an integer >= 1", "path": "a file path (~user: a user that exists)", "text": "any text",
            "names": "backend names, comma-separated, or ours"}
_NAME = re.compile(r"[a-z][a-z0-9_]*")


def _setting(name):
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"unknown setting {name!r}; known: {', '.join(SETTINGS)}") from None


@functools.lru_cache(maxsize=256)
def _parse(name, raw):
    """The value of environment string `raw` for setting `name`; ConfigError if not allowed."""
    s = SETTINGS[name]
    bad = ConfigError(f"{s.env}={raw!r} is not allowed: it takes {_ALLOWED[s.kind]} ({s.doc})")
    if s.kind == "bool":
        if raw not in ("0", "1"):
            raise bad
        return raw == "1"
    if s.kind == "tune":
        if raw not in ("auto", "on", "off"):
            raise bad
        return raw
    if s.kind in ("mib", "fraction"):
        try:
            value = float(raw)
        except ValueError:
            raise bad from None
        if not _in_range(s.kind, value):
            raise bad
        return value
    if s.kind in ("count", "positive"):
        if not re.fullmatch(r"[0-9]+", raw.strip()) or (s.kind == "positive" and int(raw) < 1):
            raise bad
        return int(raw)
    if s.kind == "path":
        if not _expandable(raw):
            raise bad
        return raw
    if s.kind == "names":
        names = _names(raw.split(","))
        if names is None:
            raise bad
        return names
    return raw


def _items(value):
    """An override's names: "gemm,fbfft" as the environment gives them, or a sequence."""
    return value.split(",") if isinstance(value, str) else list(value)


def _names(items):
    """A tuple of distinct backend-name-shaped strings, in order, or None if any is not one."""
    names = tuple(dict.fromkeys(str(v).strip() for v in items))
    ok = names and all(isinstance(v, str) for v in items) and all(_NAME.fullmatch(n) for n in names)
    return names if ok else None


def _expandable(raw):
    """A path that is not blank and whose ~ or ~user expands (~nosuchuser raised mid-run, when the
    tuning cache was first opened)."""
    return bool(raw.strip()) and not os.path.expanduser(raw).startswith("~")   # expanduser leaves ~nosuchuser


def _in_range(kind, value):
    if kind == "mib":
        return math.isfinite(value) and value > 0
    return 0 <= value < 1        # fraction; NaN fails both comparisons


def _check(s, value):
    """An override's value checked as the environment's would be (ConfigError otherwise)."""
    if value is ENVIRONMENT or value is None and s.default is None:
        return value
    ok = {"bool": lambda v: isinstance(v, bool) or isinstance(v, int) and v in (0, 1),   # 1: as the environment's
          "tune": lambda v: v in ("auto", "on", "off"),
          "mib": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and _in_range("mib", v),
          "fraction": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
          and _in_range("fraction", v),
          "path": lambda v: isinstance(v, (str, os.PathLike)) and _expandable(str(v)),
          "text": lambda v: isinstance(v, str),
          "count": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
          "positive": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
          "names": lambda v: isinstance(v, (str, tuple, list)) and _names(_items(v)) is not None}[s.kind]
    if not ok(value):
        raise ConfigError(f"setting {s.name} ({s.env}) takes {_ALLOWED[s.kind]}, got {value!r}")
    if s.kind == "names":
        return _names(_items(value))
    if s.kind == "bool":
        return bool(value)
    return float(value) if s.kind in ("mib", "fraction") else value


def show(name, value):
    """A value of setting `name` as its variable would spell it, exactly: 1 or 0 for a bool, 1024 for
    1024.0 MiB, 512.5 as it is (the settings table, backends.auto's tuning-key label)."""
    s = _setting(name)
    if s.kind == "bool":
        return "1" if value else "0"
    if s.kind in ("mib", "fraction"):
        return str(int(value)) if float(value).is_integer() else repr(float(value))
    if s.kind == "names":
        return ",".join(value)
    return str(value)

"""Train a model of the zoo with minitorch-fft: `python train.py` or `python -m minitorch_fft`.

Each training step (forward and backward) runs inside backends.reuse_spectra(): the FFT backends
compute each layer's x, w and gy spectra once and share them across fprop, bprop and accGrad.
--no-reuse-spectra makes every pass compute its own (less memory held between the passes).
--cuda-graph runs the first step eagerly (auto tunes there), then captures the whole step (forward,
backward, update) as one CUDA graph and replays it for every full batch (minitorch_fft.graphs):
the GPU no longer waits for Python between kernels. A partial last batch runs eagerly.

--resume continues the run saved in --checkpoint exactly: the flags that define the run (model,
data, epochs, batch size, optimiser settings, seed) come from the checkpoint, and giving one
with another value is an error. The backend may change (the same arithmetic, up to rounding).

--gpus N trains data-parallel on N GPUs, one process each (minitorch_fft.distributed, where
the logic lives): --batch-size is per GPU. It also runs under an external launcher (torchrun)
that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Rank 0 alone prints and
writes the checkpoint; a rank that fails or gets SIGTERM stops every rank without saving (the
last checkpoint stays, and --resume with the same --gpus continues from it).

Progress bars, one line per epoch and a one-line summary go to stderr; stdout holds one line, a
JSON object with the results ("finished": false where --max-epochs-this-run stopped the run before
--epochs). Exit codes: 0 done, 2 bad input (one line, before training), 3 the loss became NaN or
infinite (nothing is saved: the last checkpoint is the last good state), 4 another data-parallel
rank failed, 5 out of memory while training (the checks before training size what a batch's forward
keeps for backward, a lower bound, not the backward's own arrays or a backend's scratch; the last
checkpoint stays), 6 a file could not be written while or after training (a checkpoint: the one
before it stays; the --tune-report: the run's result is already on stdout), 130 / 143 stopped by
SIGINT / SIGTERM after saving (130 also for Ctrl-C before training starts: one line, nothing
saved; a second signal stops at once, the save in flight abandoned and the last checkpoint kept).
"""
import argparse
import json
import os
import signal
import sys
import tempfile
import time
import warnings

import numpy as np
from tqdm import tqdm

from . import backends
from .backends.common import available_bytes, check_fits, format_bytes
import minitorch_fft as mt
from . import models
from minitorch_fft import distributed
from minitorch_fft.checkpoint import CheckpointError
from minitorch_fft.utils import atomic_file

# Defaults: the bundled digits run finishes in well under two minutes on a 2-core CPU.
DEFAULTS = dict(model="digits", backend="auto", data="digits", epochs=10, batch_size=32, lr=0.05,
                momentum=0.9, weight_decay=5e-4, device="auto", seed=0, fake_size=1024, num_classes=None,
                gpus=None, skip_bad_images=False)
# The flags that define a run: --resume takes them from the checkpoint.
RUN_FLAGS = ("model", "data", "epochs", "batch_size", "lr", "momentum", "weight_decay", "seed",
             "fake_size", "num_classes", "gpus", "skip_bad_images")
EXIT_DIVERGED = 3
EXIT_OUT_OF_MEMORY = 5
EXIT_WRITE_FAILED = 6
# Flags of some data sources only: refused with another (a fresh run's and a resumed run's alike).
DATA_ONLY_FLAGS = {"fake_size": ("fake",), "num_classes": ("fake",), "skip_bad_images": ("imagefolder",),
                   "workers": ("imagefolder", "cifar10")}


class OutOfMemoryInTraining(Exception):
    """A MemoryError in the training loop or the evaluation after it: main() says it in one line, exit 5."""


class WriteFailed(Exception):
    """A checkpoint or report that could not be written once training had started (a full disk): main()
    says which file and what stays, in one line, exit 6."""


class _StopNow(BaseException):
    """A second SIGINT or SIGTERM in the training loop or its saves: stop at once. A BaseException, so
    that no handler of Exception takes it; a save it interrupts removes its temporary file
    (utils.atomic_file), and the checkpoint before it stays."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def int_at_least(lo, what):
    """An argparse type: an int >= lo, else an error saying `expected <what>, got ...`."""
    def parse(s):
        try:
            v = int(s)
        except ValueError:
            v = None
        if v is None or v < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v
    return parse


positive_int = int_at_least(1, "a positive integer")
nonneg_int = int_at_least(0, "an integer >= 0")


def seed_int(s):
    """--seed: an int in [0, 2**64), what a checkpoint's run state keeps (a larger one saved a run
    that --resume then refused)."""
    v = nonneg_int(s)
    if v >= 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {s!r}")
    return v


def momentum_float(s):
    """--momentum: a number in [0, 1) (at 1 or more the momentum buffer grows without bound; the
    library's SGD takes what PyTorch's does)."""
    v = nonneg_float(s)
    if v >= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {s!r} (at 1 or more SGD's steps "
                                         "grow without bound)")
    return v


def nonneg_float(s, allow_zero=True):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not np.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(f"expected a finite number {'>= 0' if allow_zero else '> 0'}, got {s!r}")
    return v


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help: each flag's default after its help line (unless the line states it), the epilog as
    written."""

    def _get_help_string(self, action):
        return action.help if "(default" in action.help else super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its errors one line like every other bad input's (argparse prints its usage
    block first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def _parser(explicit_only=False, prog=None):
    """The command line; with explicit_only, absent flags stay out of the namespace (so a caller
    can tell `--lr 0.05` from the default)."""
    def default(name):
        return argparse.SUPPRESS if explicit_only else DEFAULTS[name]

    p = _Parser(prog=prog, description=__doc__.split("\n")[0], formatter_class=_HelpFormatter,
                                epilog=__doc__.split("\n", 2)[2],
                                argument_default=argparse.SUPPRESS if explicit_only else None)
    p.add_argument("--model", choices=models.names(), default=default("model"),
                   help="the network (minitorch_fft.models): digits takes 1x8x8 images, overfeat_fast 3x231x231, the "
                        "others 3x224x224")
    p.add_argument("--backend", choices=["auto"] + backends.names(), default=default("backend"),
                   help="convolution algorithm for every layer (auto: best that supports each layer)")
    p.add_argument("--data", default=default("data"),
                   help="digits (bundled) | fake | imagefolder:PATH | cifar10:PATH (local files, never downloaded)")
    p.add_argument("--epochs", type=positive_int, default=default("epochs"), help="epochs of the run")
    p.add_argument("--batch-size", type=positive_int, default=default("batch_size"), help="images per step")
    p.add_argument("--lr", type=lambda s: nonneg_float(s, allow_zero=False), default=default("lr"),
                   help="SGD's learning rate at the start (cosine schedule down to 0 over --epochs)")
    p.add_argument("--momentum", type=momentum_float, default=default("momentum"), help="SGD's momentum, in [0, 1)")
    p.add_argument("--weight-decay", type=nonneg_float, default=default("weight_decay"),
                   help="SGD's L2 weight decay")
    p.add_argument("--device", default=default("device"), help="auto (GPU if CuPy sees one) | cpu | cuda")
    p.add_argument("--seed", type=seed_int, default=default("seed"),
                   help="seeds the weights, the data order, the digits' train/test split and dropout")
    p.add_argument("--fake-size", type=positive_int, default=default("fake_size"),
                   help="training images per epoch with --data fake")
    p.add_argument("--num-classes", type=positive_int, default=default("num_classes"),
                   help="classes for --data fake (default: 10 for digits, 1000 otherwise)")
    p.add_argument("--skip-bad-images", action="store_true", default=default("skip_bad_images"),
                   help="imagefolder: leave out files that are not images or exceed Pillow's pixel limit, "
                        "counted in the summary (default: the first one is an error before training)")
    p.add_argument("--workers", type=positive_int,
                   help="threads decoding images for imagefolder / cifar10 (default: min(8, CPUs)); "
                        "the batches do not depend on it")
    p.add_argument("--checkpoint", help="file to save after every epoch and on Ctrl-C / SIGTERM (default: none)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run saved in --checkpoint (default: start a new run)")
    p.add_argument("--tune-report",
                   help="with --backend auto: write the autotuner's per-layer, per-pass choices here as JSON "
                        "(default: none)")
    p.add_argument("--no-reuse-spectra", action="store_true",
                   help="FFT backends compute every spectrum in every pass (default: shared within a step)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="GPU only: replay each full-batch training step as one captured CUDA graph "
                        "(default: eager steps)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars; the per-epoch lines stay (default: bars on stderr where it is a "
                        "terminal, none where it goes to a file or a pipe)")
    p.add_argument("--gpus", type=positive_int, default=default("gpus"),
                   help="data-parallel training on this many GPUs, one process each; --batch-size is "
                        "then per GPU (default: one process, no NCCL)")
    p.add_argument("--max-epochs-this-run", type=positive_int,
                   help="stop (with a checkpoint) after this many epochs; --resume continues "
                        "(default: run to --epochs)")
    return p


def parse_args(argv=None, prog=None):
    p = _parser(prog=prog)
    args = p.parse_args(argv)
    args.explicit = set(vars(_parser(explicit_only=True, prog=prog).parse_args(argv)))
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint PATH")
    if args.max_epochs_this_run and not args.checkpoint:
        p.error("--max-epochs-this-run needs --checkpoint PATH (else the stopped run is lost)")
    if not args.resume:          # a resumed run's --data comes from its checkpoint: checked there
        check_fake_flags(args)
    return args


def check_fake_flags(args):
    """Flags of some data sources only are refused with another."""
    for flag, kinds in DATA_ONLY_FLAGS.items():
        if flag in args.explicit and args.data.partition(":")[0] not in kinds:
            raise ValueError(f"--{flag.replace('_', '-')} applies to --data {' or '.join(kinds)} only "
                             f"(got --data {args.data})")


def check_outputs(args, resumed=None):
    """Fail before training, not after it, on output paths that cannot be written, and on any that
    would replace a file the run did not make (nothing is created here: a folder a path needs is
    made when the run first writes there). resumed: the checkpoint's run state (restore_run), whose
    saved --tune-report, the same path, the resumed run may replace (args.replace_report)."""
    for flag, path in (("--checkpoint", args.checkpoint), ("--tune-report", args.tune_report)):
        if path is not None and not path.strip():
            raise ValueError(f"{flag} is an empty path (an unset shell variable?); give a file path")
        if path and path.endswith((os.sep, os.altsep or os.sep)):
            raise ValueError(f"{flag} {path!r} ends with a path separator, which names a folder; give a file path")
    if args.checkpoint:
        mt.checkpoint.check_file_path(args.checkpoint, "--checkpoint")   # a link, a directory, a FIFO
        if os.path.exists(args.checkpoint) and not args.resume:
            raise ValueError(f"--checkpoint {args.checkpoint!r} already exists; --resume continues "
                             "that run (or remove the file, or choose another path, to start anew)")
        _check_writable_folder(args.checkpoint, "--checkpoint")
    if args.tune_report:
        if args.backend != "auto":
            raise ValueError(f"--tune-report reports the autotuner's choices: it needs --backend auto, "
                             f"got --backend {args.backend}")
        if os.path.isdir(args.tune_report):
            raise ValueError(f"--tune-report {args.tune_report!r} is a directory; give a file path")
        saved = ((resumed or {}).get("args") or {}).get("tune_report")
        args.replace_report = bool(resumed and saved and _same_path(saved, args.tune_report))
        if os.path.lexists(args.tune_report) and not args.replace_report:   # (a resumed run's own: replaced)
            raise ValueError(f"--tune-report {args.tune_report!r} already exists; a report never replaces a "
                             "file but the resumed run's own: choose another path (or remove that one)")
        if args.checkpoint and _same_path(args.tune_report, args.checkpoint):
            raise ValueError(f"--tune-report {args.tune_report!r} is the --checkpoint path; give them two paths")
        if args.checkpoint and _same_path(args.tune_report, mt.checkpoint.lock_path(args.checkpoint)):
            raise ValueError(f"--tune-report {args.tune_report!r} is the checkpoint's lock file; choose another path")
        _check_writable_folder(args.tune_report, "--tune-report")


def check_tune_cache():
    """ValueError, before any work, where MINITORCH_TUNE_CACHE names a path the tuning cache cannot
    use: a directory, a file that is not a tuning cache (the cache would leave it untouched and
    keep its choices in memory, with a warning in the middle of the run; an empty file, as mktemp
    makes, is one), or a new file in a folder that cannot be written or made. A cache of its own
    that is read-only is read, and kept so. The default path (unset) is not checked: a run that
    cannot keep its choices there still trains."""
    raw = backends.config.get("tune_cache")
    if not raw:
        return
    env, path = backends.config.SETTINGS["tune_cache"].env, str(backends.tuning.cache_path())
    if os.path.isdir(path):
        raise ValueError(f"{env}={raw!r} is a directory; give the tuning cache's file path")
    if os.path.lexists(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            why = backends.tuning.TuneCache(path).foreign()
        if why:
            raise ValueError(f"{env}={raw!r}: {why}; it is left untouched: give a tuning cache's path or a new one")
    else:
        _check_writable_folder(path, env)


def _same_path(a, b):
    return os.path.realpath(a) == os.path.realpath(b)


def _check_writable_folder(path, flag):
    """ValueError unless `path`'s folder is writable or can be made: its nearest existing ancestor
    is a writable folder (made by the run's first write there, not here). Writable is tried, not read
    from the mode bits: a file is made there and removed (root passes os.access anywhere, /proc too)."""
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{flag} {path!r}: cannot create its folder ({existing!r} is a file)")
    why = None if os.access(existing, os.W_OK | os.X_OK) else "permission denied"
    if why is None:
        try:
            fd, probe = tempfile.mkstemp(dir=existing, prefix=".minitorch_fft_probe_")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            why = e.strerror or str(e)
    if why is not None:
        raise ValueError(f"{flag} {path!r}: " + (f"its folder {folder!r} is not writable ({why})" if existing == folder
                                                 else f"cannot create its folder ({existing!r} is not writable: {why})"))


def restore_run(args, meta):
    """The run's flags from a train.py checkpoint: taken where not given, refused where given
    with another value (a resumed run must read the same data in the same order)."""
    extra = meta.get("extra", {})
    saved = extra.get("args")
    if "progress" not in extra or "rng" not in extra or not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {args.checkpoint!r} was not written by train.py (it has no "
                              "training progress to resume); load it with mt.checkpoint.load instead")
    mt.checkpoint.check_run_state(extra)   # every field train.py reads, checked before it is used
    kind = str(saved.get("data", "")).partition(":")[0]
    for flag in RUN_FLAGS:
        if flag not in saved:
            continue
        # a flag of another data source is refused below as a new run's would be (check_fake_flags);
        # the others are compared as the run used them (--num-classes 10 is a digits-sized fake run's None)
        applies = kind in DATA_ONLY_FLAGS.get(flag, (kind,))
        ran = _as_run(flag, saved[flag], saved)
        if flag in args.explicit and applies and _as_run(flag, getattr(args, flag), saved) != ran:
            raise ValueError(f"--resume: --{flag.replace('_', '-')} {getattr(args, flag)} differs from the "
                             f"checkpoint's {ran}; a resumed run keeps its flags (start a new run "
                             "to change them)")
        setattr(args, flag, saved[flag])
    if "backend" not in args.explicit and saved.get("backend"):
        args.backend = saved["backend"]
    check_fake_flags(args)
    return extra


def _as_run(flag, value, saved):
    """A run flag's value as the run used it: --num-classes' default (None) is the number of classes
    load_data gives fake data for the saved model."""
    if flag == "num_classes" and value is None:
        return fake_classes(saved.get("model"))
    return value


def fake_classes(model, num_classes=None):
    """--data fake's number of classes: --num-classes, else 10 for the digits model, 1000 for the others."""
    return num_classes or (10 if model == "digits" else 1000)


def load_data(spec, model, seed, fake_size, num_classes, workers=None, skip_bad_images=False):
    """(train, test, num_classes) for a --data spec (workers: image-decoding threads)."""
    shape = models.input_shape(model)
    kind, _, path = spec.partition(":")
    path = os.path.expanduser(path)   # the shell expands ~ only at a word's start, not after "imagefolder:"
    if kind == "digits" and not path:
        if seed >= 2**32:
            raise ValueError(f"--data digits is split as scikit-learn splits it, with NumPy's RandomState, whose seeds "
                             f"go up to 2**32 - 1; got --seed {seed}")
        if shape != (1, 8, 8):
            raise ValueError(f"model {model!r} expects input {shape}; the digits are 1x8x8 "
                             "(use --data fake, imagefolder:PATH or cifar10:PATH)")
        train, test = mt.data.digits(seed=seed)
        return train, test, 10
    if kind == "fake" and not path:
        n_cls = fake_classes(model, num_classes)
        return (mt.data.FakeDataset(fake_size, shape, n_cls, seed),
                mt.data.FakeDataset(max(1, fake_size // 8), shape, n_cls, seed + 1), n_cls)
    if kind == "imagefolder" and path:
        train, test = mt.data.imagefolder(path, shape, seed=seed, workers=workers, skip_bad=skip_bad_images)
        return train, test, len(train.ds.dataset.classes)
    if kind == "cifar10" and path:
        train, test = mt.data.cifar10(path, shape, seed=seed, workers=workers)
        return train, test, 10
    raise ValueError(f"bad --data {spec!r}; expected digits, fake, imagefolder:PATH or cifar10:PATH")


BIG_HEAD = 10_000   # classes above which check_model_fits sizes the model before it is made


def check_same_data(spec, saved, train):
    """ValueError where a resumed run's image folder is not the one its checkpoint was made on (files
    added, removed or renamed since: data.fingerprint): its split and batches would differ from the
    run's. A checkpoint from before the fingerprint, or data that cannot change, is not checked."""
    now = getattr(train, "fingerprint", None)
    if saved is None or now is None or saved == now:
        return
    change = (f"{now['images']:,} images where the checkpoint's run read {saved['images']:,}"
              if now["images"] != saved["images"] else
              f"{now['images']:,} images, as the checkpoint's run did, but not the same files")
    raise ValueError(f"--resume: --data {spec} now holds {change}; a resumed run must read the same data "
                     "(put the folder back as it was, or start a new run)")


def check_model_fits(model, num_classes, device, momentum=0.9):
    """ValueError, before the model is made, where its parameters with their gradients (and momentum
    buffers where momentum is not 0) cannot fit (a --num-classes in the millions: the classifier's
    last layer is num_classes rows of its input features); on the GPU the host holds the weights
    alone while they are made. Sized by making the model with one class (up to ~4 s for VGG-16, the
    random state put back after it). Up to BIG_HEAD classes the zoo's models are what they are: unchecked."""
    if num_classes <= BIG_HEAD:
        return
    rng = mt.random.get_state()          # the sizing model's draws must not move the run's weights
    try:
        one = models.get(model, num_classes=1, backend="gemm")     # the same model with one class, on the host
    except MemoryError as e:
        raise ValueError(f"model {model} does not fit in the host's memory ({e})") from None
    finally:
        mt.random.set_state(rng)
    head = [m for m in one.modules() if isinstance(m, mt.nn.Linear)][-1]
    params = sum(p.data.size for p in one.parameters()) + (num_classes - 1) * (head.in_features + 1)
    del one
    arrays = 3 if momentum else 2        # weights, gradients, momentum buffers
    what = f"model {model} with {num_classes:,} classes ({params:,} parameters"
    training = what + f", with their gradients{' and momentum' if momentum else ''})"
    if device == "cuda":                 # made on the host, trained on the GPU
        check_fits(params * 4, np, what + ")")
        check_fits(params * 4 * arrays, mt.device.cupy_or_none(), training + " on the GPU")
    else:
        check_fits(params * 4 * arrays, np, training)


def check_activations_fit(model, input_shape, images, device):
    """ValueError, before training, where what a step keeps for its backward pass on a batch of
    `images` (training.saved_bytes_per_image, a lower bound) cannot fit in the memory the device
    has available now (the model, on the host still, not yet on the GPU). Where the kernel
    overcommits, the host's allocations would succeed and the OOM killer end the run mid-epoch, with
    no message; on the GPU the step would fail (exit 5) after the data were read and auto had timed
    its first layers."""
    xp = np if device == "cpu" else mt.device.cupy_or_none()
    limit, source = available_bytes(xp)
    if limit is None:
        return
    per_image = mt.training.saved_bytes_per_image(model, input_shape, device)
    if images * per_image <= limit:
        return
    fits = limit // per_image
    raise ValueError(f"a training step on a batch of {images:,} images of {tuple(input_shape)} keeps at least "
                     f"{format_bytes(images * per_image)} for its backward pass ({format_bytes(per_image)} an "
                     f"image), more than the {format_bytes(limit)} {source}; "
                     + (f"--batch-size {fits:,} is the most that could fit (the weights, gradients and the "
                        "backward's scratch come on top): try less" if fits else "not even one image fits"))


def evaluate(model, dataset, batch_size, device):
    model.eval()
    correct = 0
    with mt.no_grad():
        for x, y in mt.data.batches(dataset, batch_size, shuffle=False):
            logits = model(mt.Tensor(mt.to_device(x, device)))
            correct += int((logits.numpy().argmax(axis=1) == y).sum())
    model.train()
    return correct / len(dataset)


def _place(epochs_done, batches_done, epochs):
    """Where a run of `epochs` stands, counted as the progress bars count (epochs from 1): "in epoch
    3 after batch 25", "at the start of epoch 3", or "after its last epoch (3 of 3)"."""
    if batches_done:
        return f"in epoch {epochs_done + 1} after batch {batches_done}"
    if epochs_done >= epochs:
        return f"after its last epoch ({epochs_done} of {epochs})"
    return f"at the start of epoch {epochs_done + 1}"


def main(argv=None, prog="train.py"):
    """Run the command line `argv` (default: sys.argv[1:]) and return its exit code (module
    docstring). Bad input, a bad MINITORCH_* setting included, is one line on stderr and exit code
    2 (MINITORCH_DEBUG=1: the traceback instead); `prog` names the program in messages."""
    try:
        with warnings.catch_warnings():   # the library's warnings (a tuning cache it cannot write...): one line each
            warnings.showwarning = _one_line_warning(prog)
            return run(argv, prog)
    except WriteFailed as e:
        if _debug():
            raise
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    except _StopNow as stop:   # a second signal just before or after the training loop's own handling of it
        print(f"{prog}: {signal.Signals(stop.signum).name} again: stopped at once", file=sys.stderr)
        return 128 + stop.signum
    except (ValueError, TypeError, OSError, CheckpointError) as e:
        if _debug():
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except OutOfMemoryInTraining as e:
        if _debug():
            raise
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    except MemoryError as e:   # before training (reading a checkpoint, the data): bad input's exit code
        if _debug():
            raise
        print(f"{prog}: error: out of memory before training ({e})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # Ctrl-C outside the training loop (which saves and returns 130 itself)
        if _debug():
            raise
        print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _file_id(path):
    """(inode, mtime) of the file at `path`, None where there is none: whether a save replaced it."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _one_line_warning(prog):
    """warnings.showwarning for the command line: `train.py: warning: ...`, without the source line."""
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"{prog}: warning: {message}", file=sys.stderr if file is None else file)
    return show


def run(argv=None, prog="train.py"):
    """main() without its error handling: bad input raises ValueError, TypeError, OSError or
    CheckpointError (argparse's own usage errors exit 2 as SystemExit)."""
    args = parse_args(argv, prog)   # first: --help answers whatever the environment holds
    backends.config.check()   # a bad MINITORCH_* value: one line and exit 2, before any work
    unknown = backends.config.unknown_variables()   # and a misspelt name, which would be ignored
    if unknown:
        name, close = unknown[0]
        raise ValueError(f"{name} is not a setting of minitorch-fft" + (f" (did you mean {close}?)" if close else "")
                         + "; `python -m minitorch_fft.backends` lists them: unset it or correct its name")
    backends.auto_registry()  # and an auto_backends name that is not registered
    check_tune_cache()
    if args.resume and not os.path.lexists(args.checkpoint) and os.path.lexists(mt.checkpoint.lock_path(args.checkpoint)):
        with mt.checkpoint.held(args.checkpoint):   # a run before its first save holds it: that, not "does not exist"
            pass
    resumed = restore_run(args, mt.checkpoint.header(args.checkpoint)) if args.resume else None
    check_outputs(args, resumed)
    if args.gpus is not None and distributed.launched() is None:   # start one process per GPU
        train, _, _ = load_data(args.data, args.model, args.seed, args.fake_size, args.num_classes, args.workers,
                                args.skip_bad_images)
        distributed.check_launch(args.gpus, args.batch_size, len(train), args.device)
        return distributed.spawn(args.gpus, [sys.executable, "-m", "minitorch_fft"] +
                                 list(sys.argv[1:] if argv is None else argv), prog)
    if not args.checkpoint or not distributed.is_rank0():   # rank 0 alone writes it
        return _train(args, resumed, prog)
    with mt.checkpoint.held(args.checkpoint):   # the path is this run's until it ends
        for file, size in mt.checkpoint.remove_partial_saves(args.checkpoint):
            print(f"{prog}: removed {file} ({format_bytes(size)}), what was written of a save before its run was "
                  "killed", file=sys.stderr)
        return _train(args, resumed, prog)


def _train(args, resumed, prog):
    """run()'s training, once the arguments are checked and the checkpoint path is held."""
    group = distributed.join(args, prog)       # None unless a data-parallel rank
    if group is None:
        return _train_in(args, resumed, prog, None)
    with group.failing_together():             # an exception here stops every rank
        return _train_in(args, resumed, prog, group)


def _train_in(args, resumed, prog, group):
    quiet = group is not None and group.rank != 0     # rank 0 alone prints and saves
    args.no_progress = args.no_progress or quiet
    device = "cuda" if group is not None else mt.normalize_device(args.device)
    if args.backend != "auto" and args.backend not in backends.names(device):
        runs_on = getattr(backends.get(args.backend), "DEVICES", ())
        raise ValueError(f"--backend {args.backend} does not run on the {'GPU' if device == 'cuda' else 'CPU'} "
                         f"(it runs on: {', '.join(runs_on)}); choose another --backend or --device")
    if args.cuda_graph and device != "cuda":
        raise ValueError(f"--cuda-graph needs the GPU (--device cuda), got --device {args.device} "
                         f"({device})")
    mt.manual_seed(args.seed)
    train, test, n_cls = load_data(args.data, args.model, args.seed, args.fake_size, args.num_classes,
                                   args.workers, args.skip_bad_images)
    if group is None and len(train) < args.batch_size:   # (data-parallel: check_launch refused it)
        print(f"{prog}: --batch-size {args.batch_size} is more than the {len(train):,} training images: each "
              "epoch is one step of them all", file=sys.stderr)
    skipped = getattr(train, "skipped", [])
    for file, reason in skipped:
        print(f"{prog}: skipped {file}: {reason}", file=sys.stderr)
    for dataset in (train, test):   # an epoch's order and a batch must fit: refused now, not mid-run
        mt.data.check_memory(dataset, args.batch_size, models.input_shape(args.model),
                             np if device == "cpu" else mt.device.cupy_or_none())
    if resumed is not None:   # the progress must fit this data set: found now, not after an epoch
        check_same_data(args.data, resumed.get("data"), train)   # first: the clearer message where both fail
        mt.checkpoint.check_run_state(resumed, n_train=len(train))
    check_model_fits(args.model, n_cls, device, args.momentum)
    try:
        model = models.get(args.model, num_classes=n_cls, backend=args.backend)
        check_activations_fit(model, models.input_shape(args.model), min(args.batch_size, len(train)), device)
        model.to(device)
    except MemoryError as e:   # numpy's or CuPy's: one line, before any step
        raise ValueError(f"model {args.model} with {n_cls:,} classes does not fit in the "
                         f"{'GPU' if device == 'cuda' else 'host'}'s memory ({e})") from None
    opt = mt.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                       weight_decay=args.weight_decay,
                       lr_schedule=lambda e: 0.5 * (1 + np.cos(np.pi * e / args.epochs)))  # cosine
    criterion = mt.CrossEntropyCriterion()

    # Progress that a checkpoint carries: where we are, and the loss curve so far.
    state = {"epoch": 0, "batch": 0, "history": [], "loss_sum": 0.0, "correct": 0, "seen": 0}
    if resumed is not None:
        mt.checkpoint.load(args.checkpoint, model, opt)
        state.update(resumed["progress"])
        rng = resumed["rng"]
        if group is not None:     # rank 0's snapshot, its GPU's mask count moved to this rank's GPU
            rng = mt.random.on_device(rng, mt.device.cupy_or_none().cuda.Device().id)
        mt.random.set_state(rng)
        print(f"resumed {args.checkpoint} {_place(state['epoch'], state['batch'], args.epochs)}", file=sys.stderr)

    on_disk = [resumed is not None]   # whether --checkpoint holds this run (a save of it succeeded)

    def save():
        if group is not None:
            group.barrier()             # every rank has finished the epoch's steps
        if args.checkpoint and quiet:
            on_disk[0] = True           # rank 0 saves now (a rank that fails stops every rank)
        if args.checkpoint and not quiet:
            saved_args = {k: v for k, v in vars(args).items() if k not in ("explicit", "replace_report")}
            extra = {"progress": state, "rng": mt.random.get_state(), "args": saved_args}
            if getattr(train, "fingerprint", None):
                extra["data"] = train.fingerprint
            before = _file_id(args.checkpoint)
            try:
                mt.checkpoint.save(args.checkpoint, model, opt, epoch=state["epoch"], extra=extra)
            except (OSError, ValueError) as e:   # a full disk; the path made a folder meanwhile: the checkpoint before stays
                raise WriteFailed(f"could not save --checkpoint {args.checkpoint!r} "
                                  f"{_place(state['epoch'], state['batch'], args.epochs)} "
                                  f"({getattr(e, 'strerror', None) or e}){kept()}") from None
            except _StopNow:            # abandoned: on disk only if it got as far as its rename
                on_disk[0] = on_disk[0] or _file_id(args.checkpoint) != before
                raise
            on_disk[0] = True

    sync, rank, world = None, 0, 1
    if group is not None:
        group.broadcast_arrays(distributed.model_state_arrays(model))   # rank 0's weights everywhere
        sync, rank, world = distributed.GradientSync(model.parameters(), group), group.rank, group.world_size
    graphed = (mt.graphs.GraphedStep(model, criterion, opt, reuse_spectra=not args.no_reuse_spectra, sync=sync)
               if args.cuda_graph else None)
    n_batches = mt.data.num_batches(len(train), args.batch_size, world)
    first_epoch = state["epoch"]
    tuned_report_shown = False
    t_start, imgs_per_s = time.perf_counter(), None
    bars_off = True if args.no_progress else None     # None: tqdm's own, off where stderr is no terminal
    epochs = tqdm(range(state["epoch"], args.epochs), desc="epochs", disable=bars_off,
                  initial=state["epoch"], total=args.epochs)
    # Ctrl-C or SIGTERM (what schedulers send) sets a flag; the step in flight finishes, so the
    # checkpoint is consistent. A second signal stops at once (_StopNow), a save in flight too: its
    # temporary file is removed, and the checkpoint before it stays.
    interrupted = []

    def on_signal(signum, frame):
        interrupted.append(signum)
        if len(interrupted) == 2:        # the second: once (a third, while it is handled, is ignored)
            raise _StopNow(signum)
    handler = on_signal if group is None else group.on_signal    # a rank: every rank stops, no save
    previous_handlers = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

    def kept():
        """What a run that stops now leaves on disk: the last epoch's save, a resumed run's, or nothing."""
        if not args.checkpoint:
            return ""
        if on_disk[0]:
            return f"; {args.checkpoint} keeps the run as last saved"
        if state["epoch"] == first_epoch:
            return "; no epoch had finished, so there is no checkpoint"
        return "; no save of the run succeeded, so there is no checkpoint"
    # NumPy's overflow and invalid-value warnings on the way to a diverging loss: the loss check below
    # says it in one line instead
    previous_errors = np.seterr(over="ignore", invalid="ignore", divide="ignore")
    try:
        for epoch in epochs:
            opt.start_epoch(epoch)
            bar = tqdm(mt.data.batches(train, args.batch_size, seed=args.seed, epoch=epoch, start=state["batch"],
                                       rank=rank, world_size=world),
                       total=n_batches, initial=state["batch"], desc=f"epoch {epoch + 1}", leave=False,
                       disable=bars_off)
            mt.synchronize(model.parameters()[0].xp)
            t0, imgs = time.perf_counter(), 0
            for x, y in bar:
                # loss_value and the logits are host-device sync points, once per batch.
                if graphed is not None and len(y) == args.batch_size:
                    loss_dev, logits_dev = graphed(mt.to_device(x, device), y)  # y checked on the host
                    loss_value, logits_np = float(loss_dev), mt.to_device(logits_dev, "cpu")
                else:
                    loss, logits = mt.train_step(model, criterion, opt, mt.Tensor(mt.to_device(x, device)),
                                                 y, not args.no_reuse_spectra, sync)   # y checked on the host
                    loss_value, logits_np = loss.item(), logits.numpy()
                if not np.isfinite(loss_value):
                    print(f"{prog}: the loss became {loss_value} in epoch {epoch + 1} at batch "
                          f"{state['batch'] + 1} (try a smaller --lr or --weight-decay); stopping without "
                          f"saving{kept()}",
                          file=sys.stderr)
                    return EXIT_DIVERGED
                state["loss_sum"] += loss_value * len(y)
                state["correct"] += int((logits_np.argmax(axis=1) == y).sum())
                state["seen"] += len(y)
                state["batch"] += 1
                imgs += len(y)
                if args.backend == "auto" and not tuned_report_shown and not quiet:
                    tuned_report_shown = True  # the first step tuned every layer and pass
                    tqdm.write("autotuner choices:\n" + backends.auto.format_choices(), file=sys.stderr)
                bar.set_postfix(loss=f"{state['loss_sum'] / state['seen']:.4f}",
                                acc=f"{state['correct'] / state['seen']:.3f}",
                                img_s=f"{imgs / (time.perf_counter() - t0):.0f}")
                if interrupted:
                    break
            if interrupted:
                break
            mt.synchronize(model.parameters()[0].xp)
            imgs_per_s = imgs * world / max(time.perf_counter() - t0, 1e-9)    # all ranks' images
            if group is not None:      # the epoch's statistics over every rank's images
                state["loss_sum"], state["correct"], state["seen"] = group.sum_host(
                    [state["loss_sum"], state["correct"], state["seen"]]).tolist()
                state["correct"], state["seen"] = int(state["correct"]), int(state["seen"])
            state["history"].append({"epoch": epoch + 1, "loss": state["loss_sum"] / max(state["seen"], 1),
                                     "train_accuracy": state["correct"] / max(state["seen"], 1),
                                     "lr": opt.lr})
            state.update(epoch=epoch + 1, batch=0, loss_sum=0.0, correct=0, seen=0)
            save()
            last = state["history"][-1]
            epochs.set_postfix(loss=f"{last['loss']:.4f}", img_s=f"{imgs_per_s:.0f}")
            if not quiet:
                tqdm.write(f"epoch {epoch + 1}/{args.epochs}: loss {last['loss']:.4f}, train accuracy "
                           f"{last['train_accuracy']:.3f}, lr {opt.lr:.4g}, {rate(imgs_per_s)} images/s",
                           file=sys.stderr)
            if args.max_epochs_this_run and epoch + 1 - first_epoch >= args.max_epochs_this_run:
                break
        if interrupted:
            save()   # under this run's handlers still: a second signal abandons it (_StopNow)
    except _StopNow as stop:
        print(f"{prog}: {signal.Signals(stop.signum).name} again: stopped at once "
              f"{_place(state['epoch'], state['batch'], args.epochs)}{kept()}", file=sys.stderr)
        return 128 + stop.signum
    except MemoryError as e:   # NumPy's or CuPy's: a batch's activations, which nothing sized before
        raise OutOfMemoryInTraining(f"out of memory {_place(state['epoch'], state['batch'], args.epochs)} ({e}); "
                                    f"try a smaller --batch-size{kept()}") from None
    finally:
        np.seterr(**previous_errors)
        for s, handler in previous_handlers.items():
            signal.signal(s, handler)
    if interrupted:
        where = f"; saved {args.checkpoint} (resume with --resume)" if args.checkpoint else ""
        name = signal.Signals(interrupted[0]).name
        print(f"{prog}: {name}: interrupted {_place(state['epoch'], state['batch'], args.epochs)}{where}",
              file=sys.stderr)
        return 128 + interrupted[0]
    if quiet:
        return 0

    try:
        accuracy = evaluate(model, test, args.batch_size, device)
    except MemoryError as e:
        raise OutOfMemoryInTraining(f"out of memory evaluating the test set after training ({e}); try a smaller "
                                    f"--batch-size{kept()}") from None
    result = {
        "model": args.model, "backend": args.backend, "reuse_spectra": not args.no_reuse_spectra,
        "cuda_graph": args.cuda_graph, "gpus": world if group is not None else None,
        "batch_size_per_gpu": args.batch_size if group is not None else None,
        "device": backends.tuning.device_name(mt.get_array_module(model.parameters()[0].data)), "data": args.data,
        "epochs": state["epoch"], "epochs_planned": args.epochs, "finished": state["epoch"] >= args.epochs,
        "test_accuracy": round(accuracy, 4),
        "train_loss": state["history"][-1]["loss"] if state["history"] else None,
        "images_per_s": None if imgs_per_s is None else round(imgs_per_s, 1),
        "seconds": round(time.perf_counter() - t_start, 2), "history": state["history"],
        "skipped_images": len(skipped),
    }
    print(summary(result, device), file=sys.stderr)
    print(json.dumps(result, allow_nan=False))     # the last line on stdout: what scripts parse
    if args.tune_report:    # after the result: a report refused now (a file made there since) loses no result
        try:
            write_report(args.tune_report, backends.auto.choices(), replace=getattr(args, "replace_report", False))
        except OSError as e:   # a full disk, or a file made at the path meanwhile (never replaced)
            raise WriteFailed(f"could not write --tune-report {args.tune_report!r} ({e.strerror or e}); the run's "
                              "result is the JSON line on stdout") from None
    return 0


def write_report(path, rows, replace=False):
    """`rows` as JSON at `path`, its folder made if missing (again if another run's end removed it,
    empty, in between); replace=False: a file there is never replaced (FileExistsError)."""
    for attempt in range(3):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            with atomic_file(path, replace=replace) as f:
                json.dump(rows, f, indent=1)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise


def summary(result, device):
    """One line for a person: `digits on cpu: test accuracy 97.2% after 10 epochs in 12.3 s (1,234 images/s)`
    (images/s: the last epoch's training throughput)."""
    n, planned = result["epochs"], result.get("epochs_planned")
    speed = "" if result["images_per_s"] is None else f" ({rate(result['images_per_s'])} images/s)"
    if result.get("gpus"):
        device = (f"{result['gpus']} GPU{'' if result['gpus'] == 1 else 's'}, batch "
                  f"{result['batch_size_per_gpu']} per GPU ({result['batch_size_per_gpu'] * result['gpus']} a step)")
    skipped = result.get("skipped_images")
    left_out = f"; {skipped} bad image{'' if skipped == 1 else 's'} skipped" if skipped else ""
    epochs = (f"{n} epoch{'' if n == 1 else 's'}" if result.get("finished", True) else
              f"{n} of {planned} epochs (stopped by --max-epochs-this-run; --resume continues)")
    return (f"{result['model']} on {device}: test accuracy {result['test_accuracy']:.1%} after {epochs} "
            f"in {result['seconds']:.1f} s{speed}{left_out}")


def rate(images_per_s):
    """images/s for a person: 1,234; 12; 0.41 (a slow CPU's, where '0' would say nothing)."""
    return f"{images_per_s:,.0f}" if images_per_s >= 10 else f"{images_per_s:.2g}"


def _debug():
    """MINITORCH_DEBUG=1: a full traceback instead of one line (a bad value counts as off)."""
    try:
        return backends.config.get("debug")
    except backends.config.ConfigError:
        return False

"""Small helpers the backends and the core share: argument checks, atomic file writes."""
import contextlib
import os
import stat
import tempfile
import threading

import numpy as np


def is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def is_number(v):
    """A real number, Python's or NumPy's, but not a bool."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def pair(v, name):
    """int or (h, w) -> (h, w) of ints; TypeError naming `name` otherwise."""
    if is_int(v):
        return (int(v), int(v))
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(is_int(e) for e in v):
        return (int(v[0]), int(v[1]))
    raise TypeError(f"{name} must be an int or a pair (h, w) of ints, got {v!r}")


def positive_int(v, name):
    """v as an int >= 1; ValueError naming `name` otherwise."""
    if not is_int(v) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


class OpenBlocks:
    """The blocks of a process-wide state that are open at once, in the order they opened (the
    spectra blocks of backends.reuse, the PyTorch adapter's view dicts: a CUDA backward runs on
    PyTorch's own thread and must find the step's block, so the state cannot be a thread's).
    A block leaves wherever it is, by identity, so blocks of two threads that end out of order
    leave each other's as they were. `on_top(block)` is told the last open block (None when none
    is) after each change, under the lock the change holds, so that what it sets names it.

    The lock is re-entrant and each change one dict operation: the garbage collector may close an
    abandoned generator that holds a block (a `with` left suspended) in the middle of a change, on
    the same thread (Python 3.12 runs collections at a call's start, on_top's too). Its block then
    leaves inside the change, and on_top is told again until what it was told is the last block."""

    def __init__(self, on_top):
        self._blocks = {}   # id(block) -> block, in the order they opened (the dict holds them, so ids stay theirs)
        self._lock = threading.RLock()
        self._on_top = on_top

    def __len__(self):
        return len(self._blocks)

    def _top(self):
        return next(reversed(self._blocks.values()), None)

    def _publish(self):
        top = self._top()
        while True:
            self._on_top(top)
            now = self._top()
            if now is top:
                return
            top = now

    @contextlib.contextmanager
    def open(self, block):
        """`block` the last open one inside the `with`; yields it."""
        try:
            with self._lock:
                self._blocks[id(block)] = block
                self._publish()
            yield block
        finally:
            with self._lock:
                self._blocks.pop(id(block), None)
                self._publish()


@contextlib.contextmanager
def atomic_file(path, mode="w", prefix=None, replace=True):
    """Write `path` through the yielded file: it holds the old contents or the new, never part of
    either. A temporary file beside it is written, fsynced, given the permissions of the file it
    replaces (a cache kept 0600 stays private), else the umask's usual ones (mkstemp's 0600 would
    hide it from a shared group), and renamed over `path`; the folder is
    then fsynced so the rename survives a power cut. On any error the temporary file is removed
    and `path` is untouched. The folder must exist. replace=False: `path` is made, never replaced
    (a hard link of the temporary file, which fails where anything is at `path`: FileExistsError,
    and nothing there is touched)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix or os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        try:
            keep = os.stat(path).st_mode & 0o777 if replace else None   # not setuid, setgid or sticky
        except OSError:   # nothing there yet (or unreadable): a new file's permissions
            keep = None
        os.chmod(tmp, 0o666 & ~_UMASK if keep is None else keep)
        if replace:
            os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
        else:
            appeared = f"{path!r} appeared while it was being written; left as it is"
            try:
                os.link(tmp, path)     # atomic too, and refused where a file (or a link) is there
            except FileExistsError:
                raise FileExistsError(appeared) from None
            except OSError:            # a file system without hard links: claim the name, then rename onto it
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)))
                except FileExistsError:
                    raise FileExistsError(appeared) from None
                try:
                    os.replace(tmp, path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.remove(path)            # the empty file that claimed the name: ours
                    raise
            else:
                os.remove(tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(folder)


def _fsync_dir(folder):
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return                 # not every platform opens directories; the file itself is synced
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask():
    mask = os.umask(0)         # the only way to read it; done once, at import, before threads
    os.umask(mask)
    return mask


_UMASK = _umask()


def open_lock_file(path, mode=os.O_RDONLY):
    """A file descriptor of the lock file at `path` (made 0666 less the umask if missing), opened
    with `mode` (os.O_RDONLY or os.O_RDWR): never through a link (a link to nothing would have its
    target created), non-blocking (a FIFO there would hang the open), and refused unless it is a
    regular file. OSError naming the problem otherwise."""
    flags = mode | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags, 0o666)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd

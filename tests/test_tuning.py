"""The shared autotune cache and timing helpers (backends/tuning.py)."""
import json
import multiprocessing
import os
import stat
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

from minitorch_fft.backends import cgemm, tuning
from minitorch_fft.backends.common import geometry

GEOMETRY = geometry((2, 3, 8, 8), (4, 3, 3, 3), (1, 1), (1, 1))


def a_key(pass_name="fprop", device="cpu"):
    return (device,) + tuning.key(np, np.float32, GEOMETRY, pass_name, "cufft")[1:]


@pytest.fixture
def path(tmp_path):
    return tmp_path / "sub" / "autotune.json"


def test_key_is_json_able_and_names_the_device():
    key = tuning.key(np, np.float32, GEOMETRY, "bprop", "cufft")
    assert key == ("cpu", "float32", "fp32", tuple(GEOMETRY), "bprop", "cufft")
    json.dumps(key)


def test_key_names_the_gemm_precision(monkeypatch, path):
    """A choice tuned with the complex GEMM on TF32 is stored apart from the fp32 one."""
    gpu = object()                                           # stands for cupy: not numpy
    monkeypatch.setattr(tuning, "device_name", lambda xp: "cpu" if xp is np else "fake GPU")
    strict = tuning.key(gpu, np.float32, GEOMETRY, "fprop", "auto")
    with cgemm.tf32():
        tf32 = tuning.key(gpu, np.float32, GEOMETRY, "fprop", "auto")
        assert tuning.key(np, np.float32, GEOMETRY, "fprop", "auto")[2] == "fp32"  # NumPy: unaffected
    assert (strict[2], tf32[2]) == ("fp32", "tf32") and strict[3:] == tf32[3:]
    assert tuning.key(gpu, np.float32, GEOMETRY, "fprop", "auto") == strict       # restored
    assert tuning.key(np, np.float32, GEOMETRY, "fprop", "auto", math="tf32")[2] == "tf32"
    cache = tuning.TuneCache(path)
    cache.put(tf32, {"backend": "cufft"})
    assert tuning.TuneCache(path).get(strict) is None
    assert tuning.TuneCache(path).get(tf32) == {"backend": "cufft"}
    with pytest.raises(ValueError, match="GEMM precision"):
        tuning.key(np, np.float32, GEOMETRY, "fprop", "auto", math="fp16")


def test_round_trip_through_the_file(path):
    tuning.TuneCache(path).put(a_key(), {"basis": [14, 16], "gemm": "batched"})
    data = json.loads(path.read_text())
    assert data["version"] == tuning.VERSION and list(data["devices"]) == ["cpu"]
    assert tuning.TuneCache(path).get(a_key()) == {"basis": [14, 16], "gemm": "batched"}
    assert tuning.TuneCache(path).get(a_key("accgrad")) is None


def test_choices_are_kept_per_device(path):
    cache = tuning.TuneCache(path)
    cache.put(a_key(device="NVIDIA H100 80GB HBM3"), "h100 choice")
    assert cache.get(a_key(device="NVIDIA H200")) is None
    assert tuning.TuneCache(path).get(a_key(device="NVIDIA H100 80GB HBM3")) == "h100 choice"


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", json.dumps({"version": tuning.VERSION, "devices": [1]}),
                                  "my notes, not a cache", json.dumps({"version": 3, "devices": {}, "mine": 1})])
def test_a_file_that_is_not_the_caches_own_is_left_untouched(path, text):
    """A file without the cache's format marker (a user's notes, a corrupt file: which of them
    the cache once wrote cannot be told) is never renamed or replaced (it was moved to .bak and
    replaced); choices stay in memory, and the refusal is said once, not at every choice."""
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.warns(UserWarning, match="untouched"):
        cache = tuning.TuneCache(path)
    assert cache.get(a_key()) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for p in ("fprop", "bprop", "accgrad"):
            cache.put(a_key(p), 1)
    assert len(caught) == 1 and "not writing" in str(caught[0].message)
    assert cache.get(a_key("bprop")) == 1                                 # kept in memory
    assert path.read_text() == text and sorted(os.listdir(path.parent)) == ["autotune.json"]


def test_other_version_is_ignored_and_rewritten(path):
    path.parent.mkdir(parents=True)
    old_name = tuning._entry_name(a_key()[1:])
    path.write_text(json.dumps({"version": tuning.VERSION + 1, "devices": {"cpu": {old_name: "old"}}}))
    with pytest.warns(UserWarning, match="version"):
        cache = tuning.TuneCache(path)
    assert cache.get(a_key()) is None
    cache.put(a_key("bprop"), "new")
    data = json.loads(path.read_text())
    assert data["version"] == tuning.VERSION
    assert list(data["devices"]["cpu"].values()) == ["new"]


def test_version_1_file_without_the_precision_is_ignored_and_rebuilt(path):
    path.parent.mkdir(parents=True)
    v1_name = json.dumps(["float32", list(GEOMETRY), "fprop", "cufft"])
    path.write_text(json.dumps({"version": 1, "devices": {"cpu": {v1_name: {"basis": [8, 8]}}}}))
    with pytest.warns(UserWarning, match="version 1"):
        cache = tuning.TuneCache(path)
    assert cache.get(a_key()) is None
    cache.put(a_key(), "retuned")
    assert json.loads(path.read_text()) == {"format": tuning.MARKER, "version": tuning.VERSION,
                                            "devices": {"cpu": {tuning._entry_name(a_key()[1:]): "retuned"}}}
    assert json.loads(path.with_name(path.name + ".bak").read_text())["version"] == 1     # kept aside


def test_failed_write_leaves_the_old_file_and_no_temporary(path, monkeypatch):
    cache = tuning.TuneCache(path)
    cache.put(a_key(), "first")
    before = path.read_text()

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(tuning.os, "replace", refuse)
    with pytest.warns(UserWarning, match="cannot write"):
        cache.put(a_key("bprop"), "second")
    assert path.read_text() == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".lock"]
    assert cache.get(a_key("bprop")) == "second"          # still known in memory


def test_value_must_be_json_able(path):
    with pytest.raises(TypeError, match="JSON-able"):
        tuning.TuneCache(path).put(a_key(), {1, 2})
    assert not path.exists()


def test_writers_merge_instead_of_overwriting(path):
    first, second = tuning.TuneCache(path), tuning.TuneCache(path)
    first.put(a_key("fprop"), "from first")
    second.put(a_key("bprop"), "from second")
    fresh = tuning.TuneCache(path)
    assert fresh.get(a_key("fprop")) == "from first"
    assert fresh.get(a_key("bprop")) == "from second"


def test_concurrent_writers_do_not_crash(path):
    errors = []

    def writer(i):
        try:
            cache = tuning.TuneCache(path)
            for j in range(20):
                cache.put(a_key(device=f"device {i}"), j)
        except Exception as e:  # any failure of a writer fails the test below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # the final file is whole and current
        final = tuning.TuneCache(path)
    assert [final.get(a_key(device=f"device {i}")) for i in range(8)] == [19] * 8   # nobody's last choice lost
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def _put_many(path, tag, count):
    cache = tuning.TuneCache(path)
    for j in range(count):
        cache.put(a_key(device=f"{tag} {j}"), j)


@pytest.mark.skipif(tuning.fcntl is None, reason="no fcntl: concurrent writers are not locked here")
def test_concurrent_processes_keep_every_choice(path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_put_many, args=(path, tag, 60)) for tag in ("A", "B")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    final = tuning.TuneCache(path)
    assert all(final.get(a_key(device=f"{tag} {j}")) == j for tag in ("A", "B") for j in range(60))


def test_a_writer_does_not_undo_a_newer_choice_it_did_not_make(path):
    first, second = tuning.TuneCache(path), tuning.TuneCache(path)
    first.put(a_key("fprop"), "old")
    second.put(a_key("bprop"), "b")                       # second now holds fprop = "old" in memory
    first.put(a_key("fprop"), "new")
    second.put(a_key("accgrad"), "c")                     # must not write its stale fprop back
    assert tuning.TuneCache(path).get(a_key("fprop")) == "new"


@pytest.mark.parametrize("raw", [b"\xff\xfe not utf-8", b"[" * 100000 + b"]" * 100000])
def test_undecodable_or_deeply_nested_file_is_left_untouched(path, raw):
    path.parent.mkdir(parents=True)
    path.write_bytes(raw)
    with pytest.warns(UserWarning, match="does not parse"):
        cache = tuning.TuneCache(path)
    with pytest.warns(UserWarning, match="not writing"):
        cache.put(a_key(), "fresh")
    assert cache.get(a_key()) == "fresh" and path.read_bytes() == raw


def test_unreadable_file_is_never_replaced(path, monkeypatch):
    path.parent.mkdir(parents=True)
    path.write_text("someone else's choices")
    real = os.open

    def refuse(name, *args, **kwargs):
        if Path(name) == path:
            raise PermissionError(13, "Permission denied")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(tuning.os, "open", refuse)
    with pytest.warns(UserWarning, match="cannot be opened"):
        cache = tuning.TuneCache(path)
    with pytest.warns(UserWarning, match="not writing"):
        cache.put(a_key(), "mine")
    assert cache.get(a_key()) == "mine"                    # kept in memory
    assert path.read_text() == "someone else's choices"


def _within(seconds, fn):
    """fn() in a thread; fails the test if it has not returned within `seconds` (a blocked open)."""
    done = []
    t = threading.Thread(target=lambda: done.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert done, f"blocked for more than {seconds} s"
    return done[0]


def test_a_directory_or_a_fifo_at_the_path_is_left_untouched_and_nothing_blocks(tmp_path):
    folder = tmp_path / "dir.json"
    folder.mkdir()
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path in (folder, fifo):
        with pytest.warns(UserWarning, match="not a regular file"):
            cache = _within(10, lambda: tuning.TuneCache(path))
        with pytest.warns(UserWarning, match="not writing"):
            _within(10, lambda: cache.put(a_key(), 1))
        assert cache.get(a_key()) == 1
    assert folder.is_dir() and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["dir.json", "fifo.json"]          # no lock file beside them


def test_a_cache_shared_through_a_link_stays_shared(tmp_path):
    """The link is followed, its target updated in place; it used to be replaced by a private copy."""
    shared = tmp_path / "team" / "autotune.json"
    tuning.TuneCache(shared).put(a_key("fprop"), "theirs")
    link = tmp_path / "mine.json"
    link.symlink_to(shared)
    tuning.TuneCache(link).put(a_key("bprop"), "mine")
    assert link.is_symlink() and os.readlink(link) == str(shared)
    other = tuning.TuneCache(shared)
    assert (other.get(a_key("fprop")), other.get(a_key("bprop"))) == ("theirs", "mine")


def test_a_link_to_nothing_is_left_alone_and_its_target_never_made(tmp_path):
    link = tmp_path / "autotune.json"
    link.symlink_to(tmp_path / "elsewhere" / "target.json")
    with pytest.warns(UserWarning, match="a symbolic link to nothing"):
        cache = tuning.TuneCache(link)
    with pytest.warns(UserWarning, match="not writing"):
        cache.put(a_key(), 1)
    assert link.is_symlink() and not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("kind", ["dangling link", "fifo"])
def test_the_lock_path_is_never_followed_nor_blocks(tmp_path, kind):
    """A link at <file>.lock is not followed (a link to nothing had its target created), and a
    FIFO there does not hang the open: the write goes ahead unlocked, with a warning."""
    path = tmp_path / "autotune.json"
    lock = tmp_path / "autotune.json.lock"
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.symlink_to(tmp_path / "made_by_the_lock")
    cache = tuning.TuneCache(path)
    with pytest.warns(UserWarning, match="writing it unlocked"):
        _within(10, lambda: cache.put(a_key(), "ok"))
    assert tuning.TuneCache(path).get(a_key()) == "ok"
    assert not (tmp_path / "made_by_the_lock").exists()


def test_backups_of_stale_caches_are_numbered_and_never_replaced(path):
    path.parent.mkdir(parents=True)
    olds = []
    for version in (1, 2, 99):
        text = json.dumps({"version": version, "devices": {"cpu": {"old": version}}})
        olds.append(text)
        path.write_text(text)
        with pytest.warns(UserWarning, match="version"):
            tuning.TuneCache(path).put(a_key(), version)
    backups = [path.with_name(path.name + s) for s in (".bak", ".bak.2", ".bak.3")]
    assert [b.read_text() for b in backups] == olds
    assert tuning.TuneCache(path).get(a_key()) == 99


def test_written_file_is_readable_by_others_under_the_umask(path):
    tuning.TuneCache(path).put(a_key(), 1)
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask


def test_a_rewrite_keeps_the_files_permissions_and_a_read_only_cache_is_kept(path):
    """A cache made private (0600) stays so when a choice is added (it came back 0644, readable by all);
    one made read-only (0444) is not written: a warning, the choice kept in memory, the file as it was."""
    tuning.TuneCache(path).put(a_key(), 1)
    path.chmod(0o600)
    tuning.TuneCache(path).put(a_key("bprop"), 2)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o4755)                                  # setuid: not carried over to the new file
    tuning.TuneCache(path).put(a_key("accgrad"), 4)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    path.chmod(0o444)
    before = path.read_bytes()
    cache = tuning.TuneCache(path)
    assert "read-only" in cache.unwritable()
    with pytest.warns(UserWarning, match=r"it is read-only \(mode 0444\)"):
        cache.put(a_key("accgrad"), 3)
    assert path.read_bytes() == before and stat.S_IMODE(path.stat().st_mode) == 0o444
    assert cache.get(a_key("accgrad")) == 3


def test_a_cache_file_past_the_size_limit_is_never_read_nor_replaced(path, monkeypatch):
    """A file much larger than any tuning cache (a 1 GB file had been read whole, and decoded, at every
    new choice): left untouched, choices in memory, without reading it."""
    monkeypatch.setattr(tuning, "MAX_CACHE_BYTES", 1000)
    path.parent.mkdir(parents=True)
    path.write_bytes(b" " * 1001)
    with pytest.warns(UserWarning, match="holds 1,001 bytes, more than a tuning cache's limit of 1,000"):
        cache = tuning.TuneCache(path)
    with pytest.warns(UserWarning, match="not a tuning cache this code wrote"):
        cache.put(a_key(), 1)
    assert path.read_bytes() == b" " * 1001 and cache.get(a_key()) == 1


def test_cache_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MINITORCH_TUNE_CACHE", str(tmp_path / "mine.json"))
    assert tuning.cache_path() == tmp_path / "mine.json"
    assert tuning.default_cache().path == tmp_path / "mine.json"
    monkeypatch.delenv("MINITORCH_TUNE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tuning.cache_path() == Path(tmp_path) / ".cache" / "minitorch_fft" / "autotune.json"


def test_each_test_process_tunes_into_a_cache_of_its_own(tuning_cache_of_this_process, tmp_path_factory):
    """conftest's copy: not the user's ~/.cache file, and not one file shared by the xdist workers."""
    assert tuning.cache_path() == tuning_cache_of_this_process
    assert tmp_path_factory.getbasetemp() in tuning.cache_path().parents
    assert Path.home() / ".cache" not in tuning.cache_path().parents


def test_cache_location_expands_home_and_stays_put_after_chdir(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MINITORCH_TUNE_CACHE", "~/tc.json")
    assert tuning.cache_path() == tmp_path / "tc.json"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    monkeypatch.setenv("MINITORCH_TUNE_CACHE", "relative-cache.json")
    first = tuning.cache_path()
    monkeypatch.chdir(tmp_path / "b")
    assert tuning.cache_path() == first == tmp_path / "a" / "relative-cache.json"


def test_timeit_runs_warmup_then_takes_the_median(monkeypatch):
    calls = []
    clock = iter([0.0, 0.005, 1.0, 1.001, 2.0, 2.003])     # runs of 5, 1 and 3 ms
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: next(clock))
    ms = tuning.timeit(lambda: calls.append(1), np, warmup=2, repeat=3)
    assert len(calls) == 5
    assert ms == pytest.approx(3.0)
    with pytest.raises(ValueError, match="repeat >= 1"):
        tuning.timeit(lambda: None, np, warmup=0, repeat=0)


def test_timeit_in_bursts_gives_the_time_per_run(monkeypatch):
    """inner: fn() runs that many times back to back in each timed span (warm-up runs too), and
    the median span is divided by it."""
    calls = []
    clock = iter([0.0, 0.008, 1.0, 1.004, 2.0, 2.012])    # spans of 8, 4 and 12 ms: 4 runs each
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: next(clock))
    ms = tuning.timeit(lambda: calls.append(1), np, warmup=1, repeat=3, inner=4)
    assert len(calls) == 4 * 4
    assert ms == pytest.approx(2.0)
    with pytest.raises(ValueError, match="inner >= 1"):
        tuning.timeit(lambda: None, np, inner=0)


def test_tune_times_in_bursts_where_asked(monkeypatch):
    """tune(inner=n) hands n to every timed call (cudnn's engine search asks for SEARCH_INNER);
    the default leaves timeit's own (one run a span)."""
    seen = []
    monkeypatch.setattr(tuning, "timeit", lambda fn, xp, warmup, repeat, **k: (seen.append(k), fn(), 1.0)[2])
    tuning.tune(["a", "b"], lambda c: np.ones(2), np, inner=4)
    assert seen and all(k == {"inner": 4} for k in seen)
    seen.clear()
    tuning.tune(["a", "b"], lambda c: np.ones(2), np)
    assert seen and all(k == {} for k in seen)
    with pytest.raises(ValueError, match="inner must be >= 1"):
        tuning.tune(["a", "b"], lambda c: np.ones(2), np, inner=0)


# -- the recipe: tune(), select(), remembered() -------------------------------------------------

@pytest.fixture
def fake_clock(monkeypatch):
    """timeit runs fn once and returns the next fake time of the candidate that ran; returns the
    candidates in the order they were timed."""
    timed, last = [], []

    def timeit(fn, xp, warmup, repeat):
        fn()
        timed.append(last[-1])
        ms = TIMES[last[-1]]
        return ms.pop(0) if isinstance(ms, list) else ms

    monkeypatch.setattr(tuning, "timeit", timeit)
    return timed, last


TIMES = {}


def runner(last, outputs=None):
    """run(candidate): notes it ran, returns its output (outputs[c], default ones)."""
    def run(c):
        last.append(c)
        out = (outputs or {}).get(c, np.ones(4))
        if isinstance(out, Exception):
            raise out
        return out
    return run


def test_tune_runs_each_once_untimed_then_interleaved_rounds_and_the_median_decides(fake_clock):
    timed, last = fake_clock
    TIMES.clear()
    TIMES.update(a=[1.2, 1.2, 1.2], b=[5.0, 1.0, 1.0])       # b has one bad round
    record = tuning.tune(["a", "b"], runner(last), np)
    assert last[:2] == ["a", "b"]                             # the untimed, checked runs
    assert timed == ["a", "b"] * tuning.ROUNDS                # interleaved rounds
    assert record == {"choice": "b", "ms": {"a": 1.2, "b": 1.0}, "skipped": {}, "why": "fastest"}


def test_tune_skips_a_candidate_that_disagrees_or_raises_with_its_reason(fake_clock):
    timed, last = fake_clock
    TIMES.clear()
    TIMES.update(ok=2.0, wrong=0.1, broken=0.1)
    outputs = {"wrong": np.ones(4) * 1.01, "broken": MemoryError("out of memory (stub)")}
    with pytest.warns(RuntimeWarning, match="wrong disagrees with ok"):
        record = tuning.tune(["wrong", "ok", "broken"], runner(last, outputs), np, against="ok", tol=1e-3,
                             warn=True)
    assert last[0] == "ok"                                   # the reference candidate runs first
    assert record["choice"] == "ok" and set(timed) == {"ok"} and set(record["ms"]) == {"ok"}
    assert record["skipped"]["wrong"].startswith("disagrees with ok (relative error 1.00e-02 > 0.001)")
    assert record["skipped"]["broken"] == "MemoryError: out of memory (stub)"
    # an output reference instead of a candidate, named in the reason
    record = tuning.tune(["ok", "wrong"], runner(last, outputs), np, reference=np.ones(4),
                         reference_name="gemm", tol=1e-3)
    assert record["choice"] == "ok" and "disagrees with gemm" in record["skipped"]["wrong"]
    with pytest.raises(RuntimeError, match="every candidate failed"):
        tuning.tune(["wrong", "broken"], runner(last, outputs), np, reference=np.ones(4), tol=1e-3)


def test_tune_leaves_a_lone_candidate_alone_and_can_drop_hopeless_ones(fake_clock):
    timed, last = fake_clock
    assert tuning.tune(["only"], runner(last), np) == {"choice": "only", "ms": {}, "skipped": {},
                                                        "why": "only candidate"}
    assert last == [] and timed == []
    TIMES.clear()
    TIMES.update(fast=1.0, slow=[3.5, 0.1, 0.1], close=[2.9, 2.9, 2.9])
    record = tuning.tune(["fast", "slow", "close"], runner(last), np, drop_slower=3.0)
    assert timed == ["fast", "slow", "close"] + ["fast", "close"] * 2   # slow: one round only
    assert record["ms"] == {"fast": 1.0, "slow": 3.5, "close": 2.9} and record["choice"] == "fast"


def test_tied_candidates_are_timed_again_before_a_preference_decides(fake_clock):
    """Where a preference would decide among candidates tied within the margin, the tied ones get
    ROUNDS more interleaved rounds and are judged on the median of all theirs; one that is not tied
    is not timed again, and without a preference nothing is."""
    timed, last = fake_clock
    R = tuning.ROUNDS
    prefer = {"slow_start": 0, "steady": 1, "far": 2}.get
    TIMES.clear()   # slow_start's first rounds were slow (1.02 against 1.00): tied, and preferred
    TIMES.update(steady=[1.0] * 2 * R, slow_start=[1.02] * R + [0.9] * R, far=[2.0] * R)
    record = tuning.tune(["steady", "slow_start", "far"], runner(last), np, margin=0.03, prefer=prefer)
    assert timed == ["steady", "slow_start", "far"] * R + ["steady", "slow_start"] * R
    # slow_start's median over its six rounds is 0.96: the faster by more than the margin
    assert record["ms"] == {"steady": 1.0, "slow_start": 0.96, "far": 2.0}
    assert record["choice"] == "slow_start" and record["why"] == "fastest"
    # the other way round: the preferred one's later rounds are slower, and the faster one wins
    # outright, where before the re-timing the preference had taken it
    timed.clear()
    TIMES.update(steady=[1.0] * 2 * R, slow_start=[1.02] * R + [1.2] * R, far=[2.0] * R)
    record = tuning.tune(["steady", "slow_start", "far"], runner(last), np, margin=0.03, prefer=prefer)
    assert record["choice"] == "steady" and record["ms"]["slow_start"] == pytest.approx(1.11)
    # a tie that stays a tie is still the preference's
    TIMES.update(steady=[1.0] * 2 * R, slow_start=[1.02] * 2 * R, far=[2.0] * R)
    record = tuning.tune(["steady", "slow_start", "far"], runner(last), np, margin=0.03, prefer=prefer)
    assert record["choice"] == "slow_start" and record["why"].startswith("2.0% slower than steady")
    # no preference: the faster wins a tie, and nothing is timed again
    timed.clear()
    TIMES.update(steady=[1.0] * R, slow_start=[1.02] * R, far=[2.0] * R)
    record = tuning.tune(["steady", "slow_start", "far"], runner(last), np, margin=0.03)
    assert timed == ["steady", "slow_start", "far"] * R and record["choice"] == "steady"


def test_a_tied_candidate_that_fails_when_timed_again_is_skipped(fake_clock):
    timed, last = fake_clock
    R = tuning.ROUNDS
    TIMES.clear()
    TIMES.update(a=[1.0] * 2 * R, b=[1.01] * R)     # b's list runs out: its next timing raises
    record = tuning.tune(["a", "b"], runner(last), np, margin=0.03, prefer={"b": 0, "a": 1}.get)
    assert record["choice"] == "a" and set(record["ms"]) == {"a"}
    assert record["skipped"]["b"].startswith("IndexError")


def test_select_ties_within_the_margin_go_to_the_preference():
    times = {"a": 1.0, "b": 1.02, "c": 1.5}
    assert tuning.select(times) == ("a", "fastest")
    assert tuning.select(times, 0.03) == ("a", "fastest")            # no preference: the faster
    prefer = {"c": 0, "b": 1, "a": 2}.get
    winner, why = tuning.select(times, 0.03, prefer, lambda n: f"{n} preferred")
    assert winner == "b" and why == "2.0% slower than a, within the 3.0% margin: b preferred"
    assert tuning.select(times, 0.0, prefer)[0] == "a"               # zero margin: the fastest
    with pytest.raises(ValueError, match="no timed candidates"):
        tuning.select({})


def test_select_gives_a_tie_to_the_least_host_work_where_host_times_are_given():
    """With host times (auto's), candidates the margin and the preference leave tied go to the one whose
    call costs the host least, and why says so; a preference still decides first, a candidate outside
    the margin is not tied, and without a host time for every tied one the faster wins as before."""
    times, host = {"a": 1.0, "b": 1.02, "c": 1.5}, {"a": 0.9, "b": 0.05, "c": 0.01}
    winner, why = tuning.select(times, 0.03, host=host)
    assert winner == "b" and why == "2.0% slower than a, within the 3.0% margin: less host work a call (0.050 ms " \
                                    "against a's 0.900)"
    assert tuning.select(times, 0.03, {"a": 0, "b": 1, "c": 1}.get, host=host)[0] == "a"   # the preference first
    assert tuning.select(times, 0.0, host=host) == ("a", "fastest")                       # no tie
    assert tuning.select(times, 0.03, host={"a": 0.9})[0] == "a"                          # b's host unknown
    assert tuning.select({"a": 1.0, "b": 1.02}, 0.03, host={"a": 0.01, "b": 0.05}) == ("a", "fastest")
    # a host saving under the margin's share of the time (0.03 x 1.0 ms) decides nothing: it would flip
    assert tuning.select({"a": 1.0, "b": 1.008}, 0.03, host={"a": 0.012, "b": 0.011}) == ("a", "fastest")
    assert tuning.select({"a": 1.0, "b": 1.008}, 0.03, host={"a": 0.05, "b": 0.011})[0] == "b"


def test_tune_times_the_host_work_of_each_call_where_asked(monkeypatch):
    """tune(host=True) clocks run() itself around every timed call (its host work, nothing waited on),
    keeps the median a call per candidate in "host_ms", and hands the times to select."""
    clock = iter(range(10**6))
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: next(clock) * 1e-3)   # every read 1 ms later
    costs = {"busy": 3, "idle": 0}

    def run(c):
        for _ in range(costs[c]):
            tuning.time.perf_counter()   # the host's work: three clock reads, 3 ms
        return np.ones(2)
    monkeypatch.setattr(tuning, "timeit", lambda fn, xp, warmup, repeat, **k: (fn(), 1.0)[1])   # a tie
    record = tuning.tune(["busy", "idle"], run, np, margin=0.03, host=True)
    assert record["host_ms"] == {"busy": 4.0, "idle": 1.0}
    assert record["choice"] == "idle" and "less host work" in record["why"]
    assert "host_ms" not in tuning.tune(["busy", "idle"], run, np, margin=0.03)


def test_tune_decides_on_the_rounded_times_it_stores(monkeypatch):
    """A reader re-deriving the choice from a record (auto's _compared) sees the rounded times: 1.03004 ms is
    outside a 3 % margin of 1.0, its stored 1.03 inside, so tune must decide on 1.03 too."""
    last, clock = [], {"a": 1.0, "b": 1.03004}
    ticks = iter(range(10**6))
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: next(ticks) * 1e-3)   # every read 1 ms later

    def run(c):
        last.append(c)
        for _ in range(3 if c == "a" else 0):   # a's call costs the host 3 ms more: b wins if they tie
            tuning.time.perf_counter()
        return np.ones(2)
    monkeypatch.setattr(tuning, "timeit", lambda fn, xp, warmup, repeat, **k: (fn(), clock[last[-1]])[1])
    record = tuning.tune(["a", "b"], run, np, margin=0.03, prefer=lambda name: 0, host=True)
    assert record["ms"] == {"a": 1.0, "b": 1.03} and record["host_ms"] == {"a": 4.0, "b": 1.0}
    assert record["choice"] == "b"      # tied on the stored 1.03 (decided on 1.03004, a would have won)
    assert record["choice"] == tuning.select(record["ms"], 0.03, lambda name: 0, host=record["host_ms"])[0]


def test_a_record_is_written_once_and_read_back_through_the_memo(tmp_path, monkeypatch):
    monkeypatch.setenv("MINITORCH_TUNE_CACHE", str(tmp_path / "t.json"))
    calls = []
    rec = {"choice": {"basis": [8, 8]}, "ms": {"8x8": 1.5}, "skipped": {"9x9": "slow"}, "why": "fastest"}
    tune = lambda: calls.append(1) or dict(rec)   # noqa: E731
    key = a_key()
    assert tuning.remembered(key, tune) == rec and calls == [1]
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["version"] == tuning.VERSION == 4 and list(data["devices"]["cpu"].values()) == [rec]
    gets = []
    real_get = tuning.TuneCache.get
    monkeypatch.setattr(tuning.TuneCache, "get", lambda self, k: gets.append(k) or real_get(self, k))
    assert tuning.remembered(key, tune) == rec and gets == []        # the memo answers
    tuning.default_cache().put(a_key("bprop"), dict(rec, choice="other"))   # the cache changed
    assert tuning.remembered(key, tune) == rec and gets == [key]     # looked up again, not retuned
    tuning._caches.clear()                                           # a new cache object: a new process
    assert tuning.remembered(key, tune) == rec and len(gets) == 2 and calls == [1]
    # a record the caller finds invalid (or of another format) is tuned again, with a warning
    tuning._caches.clear()
    with pytest.warns(UserWarning, match="invalid cached tuning record"):
        tuning.remembered(key, tune, valid=lambda choice: choice != {"basis": [8, 8]})
    assert calls == [1, 1]


def test_enabled_reads_the_three_tune_settings(settings):
    gpu = object()
    for name in ("auto_tune", "cufft_tune", "direct_tune"):
        settings(**{name: "auto"})
        assert not tuning.enabled(name, np) and tuning.enabled(name, gpu)
        settings(**{name: "on"})
        assert tuning.enabled(name, np) and tuning.enabled(name, gpu)
        settings(**{name: "off"})
        assert not tuning.enabled(name, np) and not tuning.enabled(name, gpu)


def test_auto_cufft_and_direct_store_the_same_record_format(tmp_path, monkeypatch, settings):
    """Each tuner's entry in the file is tune()'s record: auto's, cufft's (CPU, cufft_tune on)
    and direct's (its GPU tuner driven through a fake run on NumPy arrays)."""
    from minitorch_fft.backends import auto, cufft, direct
    monkeypatch.setenv("MINITORCH_TUNE_CACHE", str(tmp_path / "t.json"))
    monkeypatch.setattr(auto, "_memory", {})
    settings(auto_tune="on", cufft_tune="on")
    x_shape, w_shape = (2, 2, 6, 6), (3, 2, 3, 3)
    auto.pick({"gemm": backends_gemm(), "cufft": cufft}, "fprop", x_shape, w_shape, (1, 1), (1, 1))
    rng = np.random.default_rng(0)
    cufft.fprop(rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32))
    g = geometry((2, 2, 6, 6), (3, 2, 3, 3), (1, 1), (0, 0))
    outputs = {name: np.ones(3) for name in direct.candidates("fprop", g)}
    record = direct._tuned(np, "fprop", g, lambda cfg: outputs[cfg.name], list(outputs))
    data = json.loads((tmp_path / "t.json").read_text())["devices"]["cpu"]
    tuners = {json.loads(name)[-1]: rec for name, rec in data.items()}
    assert set(tuners) == {"auto", "cufft", "direct"}
    for name, rec in tuners.items():
        # auto's record also names the revisions it timed where a candidate has one (gemm's
        # non-1x1 fprop: 1 since session 14's im2col), and each candidate's host work a call (tune's host)
        extra = {"revisions", "host_ms"} if name == "auto" else set()
        assert tuning.is_record(rec) and set(rec) - extra == {"choice", "ms", "skipped", "why"}, name
    assert tuners["auto"].get("revisions") == {"gemm": 1}
    assert set(tuners["auto"]["host_ms"]) == set(tuners["auto"]["ms"]) and "host_ms" not in tuners["cufft"]
    assert tuners["auto"]["choice"] in ("gemm", "cufft") and tuners["cufft"]["choice"]["basis"]
    assert tuners["direct"] == record and record["choice"] in outputs


def backends_gemm():
    from minitorch_fft.backends import gemm
    return gemm


@pytest.mark.gpu
def test_gpu_device_name_and_timing():
    import cupy
    assert tuning.device_name(cupy) and tuning.device_name(cupy) != "cpu"
    a = cupy.ones((512, 512), dtype=np.float32)
    assert tuning.timeit(lambda: a @ a, cupy, warmup=1, repeat=3) > 0


@pytest.mark.skipif(tuning.fcntl is None, reason="no fcntl here")
def test_a_filesystem_without_locks_still_gets_the_file(path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(tuning.fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match="writing it unlocked"):
        tuning.TuneCache(path).put(a_key(), "choice")
    assert tuning.TuneCache(path).get(a_key()) == "choice"


@pytest.mark.skipif(tuning.fcntl is None, reason="no fcntl here")
def test_the_lock_file_is_made_for_every_user_of_a_shared_cache(path):
    """Created 0666 less the umask and only ever opened read-only, so another user who can read
    it can lock it (an 'a'-mode open needed write permission)."""
    tuning.TuneCache(path).put(a_key(), 1)
    lock = path.with_name(path.name + ".lock")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(lock.stat().st_mode) == 0o666 & ~mask
    lock.chmod(0o444)                               # read-only, as for a second user under umask 022
    tuning.TuneCache(path).put(a_key("bprop"), 2)   # (root ignores modes; the open is O_RDONLY anyway)
    assert tuning.TuneCache(path).get(a_key("bprop")) == 2


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_reference_that_is_not_finite_tunes_nothing_and_caches_nothing(fake_clock, monkeypatch, tmp_path, bad):
    """Tuners that check on the caller's data (cufft, direct) cannot check anything when it holds
    NaN or inf: that call runs the caller's untuned choice, nothing is stored, and the next call
    with finite data tunes (before, every candidate 'disagreed' and the pass raised)."""
    timed, last = fake_clock
    monkeypatch.setenv("MINITORCH_TUNE_CACHE", str(tmp_path / "t.json"))
    reference = np.array([1.0, bad, 2.0])
    with pytest.raises(tuning.Untunable, match="not finite"):
        tuning.tune(["a", "b"], runner(last), np, reference=reference)
    with pytest.raises(tuning.Untunable):
        tuning.tune(["a", "b"], runner(last, {"a": reference}), np, against="a")
    key = a_key()
    tune = lambda: tuning.tune(["a", "b"], runner(last, {"a": reference}), np, against="a")  # noqa: E731
    record = tuning.remembered(key, tune, untuned=lambda: "b")
    assert record["choice"] == "b" and "untuned this call" in record["why"] and tuning.for_this_call_only(record)
    assert tuning.default_cache().get(key) is None and not (tmp_path / "t.json").exists()
    assert timed == []                                              # nothing was timed
    TIMES.clear()
    TIMES.update(a=1.0, b=2.0)
    assert tuning.remembered(key, lambda: tuning.tune(["a", "b"], runner(last), np, against="a"),
                             untuned=lambda: "b")["choice"] == "a"  # finite data: tuned and stored
    assert tuning.default_cache().get(key)["choice"] == "a"


def test_cufft_on_nan_data_runs_untuned_and_tunes_later(monkeypatch, tmp_path, settings):
    from minitorch_fft.backends import cufft
    settings(cufft_tune="on")
    monkeypatch.setenv("MINITORCH_TUNE_CACHE", str(tmp_path / "t.json"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    x[0, 0, 4, 4] = np.nan
    y = cufft.fprop(x, w, padding=(1, 1))
    assert np.isnan(y[0]).any() and np.isfinite(y[1]).all()          # propagated, no error
    assert not (tmp_path / "t.json").exists()                        # nothing cached from NaN data
    x[0, 0, 4, 4] = 0.0
    cufft.fprop(x, w, padding=(1, 1))
    assert (tmp_path / "t.json").exists()                            # finite data tunes


def test_unwritable_says_why_a_cache_would_stay_in_memory(tmp_path):
    from minitorch_fft.backends import tuning
    assert tuning.TuneCache(tmp_path / "new" / "deeper" / "tune.json").unwritable() is None   # folders made
    cache = tmp_path / "tune.json"
    tuning.TuneCache(cache).put(("cpu", "float32", "fp32", (1,) * 11, "fprop", "auto"), {"choice": "gemm"})
    assert tuning.TuneCache(cache).unwritable() is None
    (tmp_path / "notes.json").write_text("[1, 2]")
    with pytest.warns(UserWarning, match="untouched"):
        foreign = tuning.TuneCache(tmp_path / "notes.json")
    assert "is not a tuning cache this code wrote" in foreign.unwritable()
    (tmp_path / "a_file").write_text("x")
    with pytest.warns(UserWarning, match="cannot be opened"):
        under = tuning.TuneCache(tmp_path / "a_file" / "tune.json")
    assert under.unwritable() == f"cannot write in {tmp_path / 'a_file'}"


def test_peek_choice_answers_a_remembered_valid_choice_only(tmp_path, monkeypatch):
    """peek_choice (a prepared call's variant): the remembered record's choice where it is an int among
    the options; None where nothing is remembered, the choice is not an option, or it is not an int
    (4.0 == 4, and no kernel takes it); the file itself is never read."""
    monkeypatch.setenv("MINITORCH_TUNE_CACHE", str(tmp_path / "peek.json"))
    record = {"choice": 4, "ms": {}, "skipped": {}}
    key = a_key()
    assert tuning.peek_choice(key, (2, 4)) is None                        # nothing remembered yet
    assert tuning.remembered(key, lambda: record)["choice"] == 4
    assert tuning.peek_choice(key, (2, 4)) == 4
    assert tuning.peek_choice(key, (2,)) is None                          # not among the options
    record["choice"] = 4.0                                                # the memo holds this dict
    assert tuning.peek_choice(key, (2, 4)) is None

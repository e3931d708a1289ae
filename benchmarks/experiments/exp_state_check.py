"""A pytest plugin that looks for state one GPU test leaves behind and a later one trips on (session
50: test_errors' NaN test failed once in the whole GPU suite, never alone). After every test, in every
worker, the digits net on the GPU (a) with that test's NaN/inf input: its output must hold a NaN; (b)
with the two bad pixels zeroed: its output must equal the CPU's (relative 1e-4). A worker's first three
failures dump the state: the tests before, the output re-read after a device sync, streams, auto's
choices, prepared calls, each layer against the CPU's, conv1 on each backend, the net again with
backends' prepared calls cleared. Appends to the file --state-check-log names (state_check.log).

    PYTEST_ADDOPTS="-p benchmarks.experiments.exp_state_check --state-check-log $OUT/state_check.log" \
        bash benchmarks/gpu_all.sh
"""
import time
import traceback

import numpy as np

_state = {"n": 0, "fails": 0, "recent": [], "ref": None, "dumped": 0, "t": 0.0, "log": "state_check.log"}
WORKER = "main"


def pytest_addoption(parser):
    parser.addoption("--state-check-log", default="state_check.log", help="exp_state_check's log (appended)")


def pytest_configure(config):
    global WORKER
    _state["log"] = config.getoption("--state-check-log")
    WORKER = getattr(config, "workerinput", {}).get("workerid", "main")   # pytest-xdist's worker name


def _log(text):
    with open(_state["log"], "a") as f:
        f.write(text if text.endswith("\n") else text + "\n")


def _inputs():
    x = np.random.default_rng(0).standard_normal((1, 1, 8, 8)).astype(np.float32)
    clean = x.copy()
    x[0, 0, 2, 2], x[0, 0, 6, 6] = np.nan, np.inf
    clean[0, 0, 2, 2] = clean[0, 0, 6, 6] = 0
    return x, clean


def _net(device):
    import minitorch_fft as mt
    from minitorch_fft import models
    mt.manual_seed(0)
    return models.get("digits", 10).to(device).eval()


def _reference():
    if _state["ref"] is None:
        import minitorch_fft as mt
        _, clean = _inputs()
        _state["ref"] = _net("cpu")(mt.Tensor(clean)).numpy().copy()
    return _state["ref"]


def _check():
    import minitorch_fft as mt
    bad, clean = _inputs()
    ref = _reference()
    net = _net("cuda")
    y_bad = net(mt.Tensor(mt.to_device(bad, "cuda")))
    y_clean = net(mt.Tensor(mt.to_device(clean, "cuda")))
    yb, yc = y_bad.numpy(), y_clean.numpy()
    err = float(np.abs(yc - ref).max() / np.abs(ref).max())
    problems = []
    if not np.isnan(yb).any():
        problems.append(f"no NaN in the NaN input's output: {np.round(yb, 4).tolist()}")
    if not err <= 1e-4:
        problems.append(f"clean output differs from the CPU's: rel {err:.3g}: {np.round(yc, 4).tolist()}")
    return problems, (net, bad, clean, y_bad, y_clean)


def _dump(nodeid, problems, ctx):
    import cupy as cp
    import minitorch_fft as mt
    from minitorch_fft import backends
    from minitorch_fft.backends import cgemm, config
    net, bad, clean, y_bad, y_clean = ctx
    lines = [f"==== {WORKER}: FAIL after {nodeid} (check {_state['n']})", *problems,
             "recent tests: " + " | ".join(_state["recent"][-12:])]
    try:
        cp.cuda.Device().synchronize()
        lines.append(f"re-read after sync: bad {np.round(y_bad.numpy(), 4).tolist()} "
                     f"clean {np.round(y_clean.numpy(), 4).tolist()}")
        lines.append(f"current stream {cp.cuda.get_current_stream()!r} ptr {cp.cuda.get_current_stream().ptr}")
        lines.append(f"cgemm capture: {getattr(cgemm._capture, 'now', None)!r}")
        try:
            from minitorch_fft.backends import cudnn
            lines.append(f"cudnn handles: {[(d, getattr(h, 'stream', None)) for d, h in cudnn._handles.items()]}")
        except Exception as e:  # noqa: BLE001
            lines.append(f"cudnn: {e!r}")
        lines.append(f"config.state(): {config.state()!r}")
        lines.append(f"settings not at their defaults: {config.changed()}")
        lines.append("auto's choices:\n" + backends.auto.format_choices())
        geoms = {((1, 1, 8, 8), (16, 1, 3, 3)), ((1, 16, 8, 8), (32, 16, 3, 3))}
        for k, v in backends._prepared.items():
            if (tuple(k[2]), tuple(k[3])) in geoms:
                lines.append(f"prepared {k[:6]}: backend {getattr(v.backend, '__name__', v.backend)} run {v.run!r}")
        # layer by layer, NaN input and clean input, against the CPU layer on the same input
        for name, x in (("bad", bad), ("clean", clean)):
            h = mt.Tensor(mt.to_device(x, "cuda"))
            hc = mt.Tensor(x)
            cpu_net = _net("cpu")
            for m, mc in zip([*net.features, net.flatten, *net.classifier],
                             [*cpu_net.features, cpu_net.flatten, *cpu_net.classifier]):
                h, hc = m(h), mc(hc)
                g, c = h.numpy(), hc.numpy()
                fin = np.isfinite(c)
                d = float(np.abs(np.where(fin, g - c, 0)).max()) if fin.any() else 0.0
                lines.append(f"  {name} {m!r}: gpu NaN {int(np.isnan(g).sum())} cpu NaN {int(np.isnan(c).sum())} "
                             f"max |diff| on finite {d:.3g}")
        # each backend's fprop on conv1/conv2 with the layer's own weights, clean input
        conv1 = net.features[0]
        x1 = mt.to_device(clean, "cuda")
        for b in backends.names():
            be = backends.get(b)
            for ci, (conv, xin) in enumerate(((conv1, x1),)):
                try:
                    w = conv.weight.data
                    ok = be.supports(xin.shape, w.shape, (1, 1), (1, 1)) and backends.auto.runs_on(be, cp)
                    if not ok:
                        continue
                    out = cp.asnumpy(be.fprop(xin, w, padding=(1, 1)))
                    ref1 = cp.asnumpy(backends.gemm.fprop(cp.asarray(xin), cp.asarray(w), padding=(1, 1)))
                    lines.append(f"  backend {b} conv{ci + 1} fprop vs gemm: {float(np.abs(out - ref1).max()):.3g}")
                except Exception as e:  # noqa: BLE001
                    lines.append(f"  backend {b}: {type(e).__name__}: {e}"[:300])
        backends._prepared.clear()
        again = net(mt.Tensor(mt.to_device(bad, "cuda"))).numpy()
        lines.append(f"after _prepared.clear(): NaN {bool(np.isnan(again).any())} {np.round(again, 4).tolist()}")
    except Exception:  # noqa: BLE001
        lines.append("dump failed: " + traceback.format_exc())
    _log("\n".join(lines))


def pytest_runtest_logfinish(nodeid, location):
    from minitorch_fft.device import gpu_available
    if not gpu_available():
        return
    _state["recent"].append(nodeid)
    _state["n"] += 1
    t0 = time.perf_counter()
    try:
        problems, ctx = _check()
    except Exception as e:  # noqa: BLE001
        _log(f"{WORKER}: check raised after {nodeid}: {type(e).__name__}: {e}"[:500])
        return
    finally:
        _state["t"] += time.perf_counter() - t0
    if problems:
        _state["fails"] += 1
        if _state["dumped"] < 3:
            _state["dumped"] += 1
            _dump(nodeid, problems, ctx)
        else:
            _log(f"{WORKER}: FAIL again after {nodeid}: {problems[0][:200]}")
    elif _state["fails"]:
        _log(f"{WORKER}: passes again after {nodeid}")
        _state["fails"] = 0


def pytest_sessionfinish(session, exitstatus):
    _log(f"{WORKER}: {_state['n']} checks, {_state['t']:.1f} s in checks, first tests: "
         f"{_state['recent'][:1]} last: {_state['recent'][-1:]}")

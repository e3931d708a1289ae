"""Does a cuDNN execute that fails say so? The cudnn backend runs its plans through the frontend's
private pointer form (`_execute_with_raw_ptrs`, backends/cudnn.py `_Plan.run`) and ignores its return
value: if a failure came back as a status rather than an exception, the output would keep whatever
its fresh memory held, a silent wrong answer (session 50's one NaN-test failure gave values of no
input). Each case runs in a child process (a bad pointer can end one), the output filled with 7.0
first, and prints whether the call raised, returned with the output untouched, or ended the child.

    python -m benchmarks.experiments.exp_cudnn_failed_execute
"""
import argparse
import subprocess
import sys

CASES = {
    "ok": "the plan as the backend runs it (the control)",
    "bad_index": "a plan index the graph does not have",
    "dead_stream": "the handle bound to a stream that was destroyed",
    "public_dead_stream": "the same through the frontend's public execute_plan_at_index",
    "no_workspace": "a null workspace for a plan that needs one (skipped where the plan needs none)",
}


def child(case):
    import ctypes

    import cupy as cp
    import numpy as np

    from minitorch_fft.backends import config, cudnn
    with config.override(tf32=False, cudnn_tune="off"):
        xs, ws = (8, 64, 28, 28), (64, 64, 3, 3)
        x = cp.random.standard_normal(xs, dtype=cp.float32)
        w = cp.random.standard_normal(ws, dtype=cp.float32)
        y = cudnn.fprop(x, w, padding=(1, 1))
        cp.cuda.Device().synchronize()
        (plan,) = [p for k, p in cudnn._built.items() if k[1] == "fprop"]   # a fresh process: the one
        print(f"plan {plan.name}, workspace {plan.workspace} B, pointer form {plan.pointer_form is not None}")
        out = cp.full(y.shape, 7.0, dtype=cp.float32)
        execute, order, index = plan.pointer_form
        ws_buf = cp.empty(max(plan.workspace, 1), dtype=np.uint8)
        ptrs = (x.data.ptr, w.data.ptr, out.data.ptr)
        pack = cudnn._POINTERS(*(ptrs[i] for i in order))
        ws_ptr, handle = ws_buf.data.ptr, plan.handle
        if case == "bad_index":
            index += 1000
        if case in ("dead_stream", "public_dead_stream"):
            s = cp.cuda.Stream(non_blocking=True)
            dead = s.ptr
            del s
            import gc
            gc.collect()
            plan.cudnn.set_stream(handle, dead)
        if case == "no_workspace":
            if not plan.workspace:
                print("RESULT skipped: the plan needs no workspace")
                return
            ws_ptr = 0
        try:
            if case == "public_dead_stream":
                plan._execute_public(ptrs, ws_ptr)
            else:
                execute(ctypes.addressof(pack), len(order), ws_ptr, handle.backend_handle, index)
            cp.cuda.Device().synchronize()
        except Exception as e:  # noqa: BLE001 - what is reported
            print(f"RESULT raised {type(e).__name__}: {str(e)[:300]}")
            return
        got = cp.asnumpy(out)
        err = float(np.abs(got - cp.asnumpy(y)).max() / np.abs(cp.asnumpy(y)).max())
        untouched = bool((got == 7.0).all())
        print(f"RESULT returned: output {'UNTOUCHED (7.0 everywhere): SILENT' if untouched else 'written'}, "
              f"max rel diff from the backend's own output {err:.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=list(CASES), help=argparse.SUPPRESS)   # one case, in this process
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    rows = []
    for case, what in CASES.items():
        p = subprocess.run([sys.executable, "-m", "benchmarks.experiments.exp_cudnn_failed_execute", "--child", case],
                           capture_output=True, text=True, timeout=300)
        lines = (p.stdout + p.stderr).strip().splitlines()
        result = next((ln[len("RESULT "):] for ln in lines if ln.startswith("RESULT ")), None)
        print(f"== {case}: {what}\n" + "\n".join(lines[-6:]))
        rows.append((case, result or f"no result, exit status {p.returncode}"))
    print("\n| case | outcome |\n|---|---|")
    for case, result in rows:
        print(f"| {case} | {result} |")


if __name__ == "__main__":
    main()

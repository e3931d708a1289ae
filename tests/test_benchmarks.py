"""The benchmarks' CPU-side logic: layer tracing and command-line help (they need a GPU to run)."""
import subprocess
import sys

from benchmarks.paper import conv_layers


def test_conv_layers_trace_the_papers_networks():
    alex = conv_layers("alexnet", 128)
    assert [l[1] for l in alex] == [(128, 3, 224, 224), (128, 64, 27, 27), (128, 192, 13, 13),
                                    (128, 384, 13, 13), (128, 256, 13, 13)]
    assert alex[0][2:] == ((64, 3, 11, 11), (4, 4), (2, 2))
    over = conv_layers("overfeat_fast", 128)
    assert [l[1][2] for l in over] == [231, 28, 12, 12, 12]
    assert over[4][2] == (1024, 1024, 3, 3)


def test_help_works_without_a_gpu():
    for script in ("benchmarks/paper.py", "benchmarks/bench_cufft.py"):
        p = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
        assert p.returncode == 0 and "usage" in p.stdout, p.stderr

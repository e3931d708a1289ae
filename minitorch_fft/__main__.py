"""`python -m minitorch_fft`: the training command line, the same as `python train.py`."""
import sys

try:
    from minitorch_fft.cli import main
except KeyboardInterrupt:   # Ctrl-C while the package loads: one line, as main() says it once running
    print("python -m minitorch_fft: interrupted (Ctrl-C)", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main(prog="python -m minitorch_fft"))

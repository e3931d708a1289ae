"""`python -m minitorch_fft`: the training command line, the same as `python train.py`."""
import sys

from minitorch_fft.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m minitorch_fft"))

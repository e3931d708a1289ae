"""`python -m minitorch_fft.backends`: the settings table (backends.config.table(), as README.md's
Settings shows it). A bad MINITORCH_* value in this environment is one line and exit 2, as train.py
says it."""
import argparse
import os
import sys

from minitorch_fft.backends import config


def main(argv=None):
    argparse.ArgumentParser(prog="python -m minitorch_fft.backends", description=__doc__.split("\n\n")[0]
                            .replace("`", "")).parse_args(argv)
    try:
        config.check()
    except ValueError as e:
        print(f"python -m minitorch_fft.backends: error: {e}", file=sys.stderr)
        return 2
    try:
        print(config.table())
        sys.stdout.flush()
    except BrokenPipeError:   # `| head`: the reader left; the exit's own flush goes nowhere, not to a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())

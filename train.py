"""Train a model of the zoo with minitorch-fft.

Examples:
  python train.py                                   # small CNN on the bundled 8x8 digits, CPU or GPU
  python train.py --device cuda --backend gemm
  python train.py --model alexnet --data fake --device cuda --epochs 1
  python train.py --checkpoint runs/digits.ckpt     # save after every epoch (and on Ctrl-C)
  python train.py --checkpoint runs/digits.ckpt --resume
  python train.py --model alexnet --data imagefolder:/data/imagenette --device cuda
  python train.py --model alexnet --data fake --device cuda --backend fbfft --no-reuse-spectra
  python train.py --model alexnet --data fake --device cuda --cuda-graph
  python -m minitorch_fft --help                    # the same command line, from an installed package

What each flag does, the output (a summary line on stderr, one JSON line on stdout) and the exit
codes (0 done, 2 bad input, 3 the loss became NaN or infinite, 4 another data-parallel rank failed,
5 out of memory while training, 6 a checkpoint or report could not be written, 130 / 143 stopped by
SIGINT / SIGTERM after saving): `python train.py --help` and minitorch_fft/cli.py, where the code lives.
"""
import sys

try:
    from minitorch_fft.cli import main
except KeyboardInterrupt:   # Ctrl-C while the package loads: one line, as main() says it once running
    print("train.py: interrupted (Ctrl-C)", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main(prog="train.py"))

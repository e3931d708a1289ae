"""`python -m minitorch_fft.backends`: the settings table (backends.config.table(), as README.md's Settings shows it)."""
from minitorch_fft.backends import config

print(config.table())

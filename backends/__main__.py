"""`python -m backends`: the settings table (backends.config.table(), as README.md's Settings shows it)."""
from backends import config

print(config.table())

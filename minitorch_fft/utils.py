"""Argument checks and atomic file writes (the helpers live in backends.utils, the ground floor)."""
from .backends.utils import atomic_file, is_int, is_number, open_lock_file, pair, positive_int  # noqa: F401

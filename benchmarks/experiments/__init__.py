"""One-off experiments (not benchmarks of record): each answered one question, recorded in
benchmarks/NOTES.md; run as `python -m benchmarks.experiments.<name>` from the repository root."""

"""``python -m benchmarks``."""

from benchmarks.cli import main

main()

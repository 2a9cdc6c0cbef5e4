"""`python -m benchmarks [SUITE] ...`: the same as `pipeshard bench` (no suite: the paper run)."""

from benchmarks.suite.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

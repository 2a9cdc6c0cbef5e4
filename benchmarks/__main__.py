"""`python -m benchmarks`: the paper's experiments in one run (the same as `pipeshard bench`)."""

from benchmarks.suite.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

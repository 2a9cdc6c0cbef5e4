"""The package run as a module: `pipeshard bench` without the command line's other commands."""

from common.telemetry import keep_telemetry_off

keep_telemetry_off()  # before the suites import openvino (see common/telemetry.py)

from benchmarks.suite.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())

"""The `pipeshard` command: every role (export, stage, serve, up, bench, health) wired
together, and `up`'s local fleet."""

from common.telemetry import keep_telemetry_off
from common.version import VERSION as __version__

keep_telemetry_off()  # before any role imports openvino (see common/telemetry.py)

__all__ = ["__version__"]

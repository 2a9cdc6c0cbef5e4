"""OpenVINO's usage telemetry, off in every pipeshard process.

``import openvino`` imports its model converter (ovc), which sends a Google Analytics event
("ov", "import") whenever no ``opt_in_out --opt_out`` consent file says otherwise, and NNCF
(the exporter's int4/int8 compression) sends more. Each event goes from a child process forked
by a sender thread: a fork of a process whose OpenVINO and gRPC threads are running, which can
crash (the segfault trace some test runs printed) and, on a host without internet, waits out a
timeout. Both libraries treat a missing ``openvino_telemetry`` package as "send nothing" (their
stubs); :func:`keep_telemetry_off` makes the package unimportable in this process before
OpenVINO is imported, and sets NNCF's own switch (``NNCF_CI``) for its children.
"""

from __future__ import annotations

import os
import sys


def keep_telemetry_off() -> None:
    """Turn OpenVINO's and NNCF's telemetry off in this process and its children; call it
    before anything imports openvino or NNCF."""
    os.environ.setdefault("NNCF_CI", "1")
    if "openvino_telemetry" not in sys.modules:
        sys.modules["openvino_telemetry"] = None  # type: ignore[assignment]  # import fails

"""Start real pipeshard processes on free loopback ports and stop them by process group.

The launcher lives in ``benchmarks/processes.py`` (the installed ``pipeshard bench`` uses it too);
the tests import it from here.
"""

from benchmarks.processes import (
    PIPESHARD,
    Proc,
    free_port,
    start_gateway,
    start_pinned_stages,
    start_stages,
)

__all__ = ["PIPESHARD", "Proc", "free_port", "start_gateway", "start_pinned_stages", "start_stages"]

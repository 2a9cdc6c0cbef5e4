"""What memory this process can still take, to refuse at start a paged stage's pools that it
could not fill later.

OpenVINO allocates a pool's tensors untouched: on Linux the pages come only when sessions
write them, so a pool larger than the memory left would start, serve, and be killed when it
fills up. The stage checks its KV and state pools against this before allocating them.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")


def available_memory(proc: Path = PROC, cgroup: Path = CGROUP) -> int | None:
    """Bytes this process can still take: the kernel's MemAvailable, or less where its
    memory cgroup (a container, a systemd unit's MemoryMax) limits it; None where neither is
    known."""
    known: list[int] = []
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                known.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        groups = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        groups = []
    for line in groups:
        _, controllers, path = line.split(":", 2)
        folder = path.lstrip("/")
        if controllers == "":  # cgroup v2
            left = _left(cgroup / folder / "memory.max", cgroup / folder / "memory.current")
        elif "memory" in controllers.split(","):  # cgroup v1
            base = cgroup / "memory" / folder
            left = _left(base / "memory.limit_in_bytes", base / "memory.usage_in_bytes")
        else:
            continue
        if left is not None:
            known.append(left)
    return max(0, min(known)) if known else None


def _left(limit_file: Path, usage_file: Path) -> int | None:
    """A cgroup's limit less its usage; None without a limit (or its files)."""
    try:
        limit = limit_file.read_text().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
        return int(limit) - int(usage_file.read_text())
    except (OSError, ValueError):
        return None

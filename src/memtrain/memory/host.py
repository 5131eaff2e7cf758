"""What this node's host memory can still hold: MemAvailable, capped by the memory cgroup's room (a Slurm job's
--mem, a container's limit), cgroup v2 or v1."""
from __future__ import annotations

from pathlib import Path
from typing import Optional


def available_bytes() -> int:
    """Bytes the processes started from here can still allocate on this node."""
    available = _meminfo_available()
    room = cgroup_room()
    return available if room is None else min(available, room)


def _meminfo_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def cgroup_room() -> Optional[int]:
    """limit - usage of this process's memory cgroup and its ancestors (the tightest); None without a limit."""
    rooms = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            roots, limit_file, usage_file = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")), "memory.max", \
                "memory.current"
        elif "memory" in controllers.split(","):  # v1
            roots, limit_file, usage_file = (Path("/sys/fs/cgroup/memory"),), "memory.limit_in_bytes", \
                "memory.usage_in_bytes"
        else:
            continue
        for root in roots:
            group = root / path.lstrip("/")
            while group.is_relative_to(root):
                room = _room(group / limit_file, group / usage_file)
                if room is not None:
                    rooms.append(room)
                if group == root:
                    break
                group = group.parent
    return min(rooms) if rooms else None


def _room(limit_path: Path, usage_path: Path) -> Optional[int]:
    try:
        limit, usage = limit_path.read_text().strip(), usage_path.read_text().strip()
    except OSError:
        return None
    if limit == "max" or int(limit) >= 1 << 60:  # no limit (v1 writes a page-rounded 2^63)
        return None
    return max(int(limit) - int(usage), 0)

"""The host's memory as the operating system reports it now: total and available bytes. Imports
nothing (no torch), so the engine's KV budget and the simulator's process pool and hardware
catalog all read it the same way."""
from __future__ import annotations

import os


def _meminfo(field: str) -> int | None:
    """A /proc/meminfo figure in bytes (Linux); None when the file or the field is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _pages(name: str) -> int | None:
    try:
        return os.sysconf(name) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory_bytes() -> int | None:
    """Memory new allocations can take now: MemAvailable (free plus reclaimable cache), else free
    physical pages; None where the system says neither."""
    found = _meminfo("MemAvailable")
    return found if found is not None else _pages("SC_AVPHYS_PAGES")


def total_memory_bytes() -> int | None:
    """Physical memory: MemTotal, else all physical pages; None where the system says neither."""
    found = _meminfo("MemTotal")
    return found if found is not None else _pages("SC_PHYS_PAGES")

"""The host memory this process may still take without pushing the machine into swap: what the pinned images
of mode offload's experts' ring (device/expert_ring.py) are checked against before they are built
(expert_budget.expert_images_fit).

MemAvailable (/proc/meminfo) is the kernel's estimate of what new allocations can take without swapping: free
memory plus the page cache it could drop.  That cache includes the model file's own mapped pages, which the
host's experts read every step, so the check takes the model's host-read bytes out of it again (budget.py's
host reserve); where MemAvailable is missing (kernels before 3.14) the free physical pages stand in, which
leave the cache out and so err towards no ring.
"""
from __future__ import annotations

import os

MEMINFO = "/proc/meminfo"


def available_bytes() -> int | None:
    """MemAvailable in bytes, else the free physical pages' bytes, else None (nothing to ask)."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024          # "MemAvailable:  61234567 kB"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None

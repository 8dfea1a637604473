"""What every benchmark prints first: the machine it ran on (CPUs vary between machines of one kind)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (`/proc/cpuinfo`), or the architecture where that is not readable."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    names = (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name"))
    return next(names, platform.machine())


def describe() -> str:
    """CPU model and count, e.g. `Intel(R) Xeon(R) Processor, 2 CPUs`."""
    return f"{cpu_name()}, {os.cpu_count()} CPUs"

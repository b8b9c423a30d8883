"""Where and when a measurement was made, stored beside its numbers (and printed in the README)."""

from __future__ import annotations

import datetime
import os
import platform


def cpu_name() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance() -> dict[str, str]:
    """``{"machine": "<cpu>, <n> cores", "date": "YYYY-MM-DD"}`` of this run."""
    return {"machine": f"{cpu_name()}, {os.cpu_count()} cores", "date": datetime.date.today().isoformat()}

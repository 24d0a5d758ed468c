"""The CPU cores this process may use: one answer for every thread-count choice (the base
model's build, each stage-4 rank)."""

import os


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; else all of them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

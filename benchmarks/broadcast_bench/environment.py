"""The environment settings that move small broadcasts, as a benchmark's JSON records
them (docs/latency.md): the learner's OpenMP wait policy and thread count (its workers
spin after a parallel op unless told otherwise), and how often Ray's raylet deletes
unused objects (once a second by default: a learner that puts faster than that writes
pages it never touched)."""

from __future__ import annotations

import os

RECORDED = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "RAY_free_objects_period_milliseconds")


def recorded_environment() -> dict[str, str | None]:
    """Each of :data:`RECORDED` as this process sees it (None: not set)."""
    return {name: os.environ.get(name) for name in RECORDED}

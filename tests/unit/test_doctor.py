"""``python -m raysync doctor`` in this process (no Ray): what it checks and prints."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from raysync.doctor import check_this_process, render
from raysync.transports import get_transport, known_transports, registered_transports


def test_every_transport_is_checked_with_its_reason():
    report = check_this_process()
    assert [c.name for c in report.transports] == list(known_transports())
    for check in report.transports:
        availability = get_transport(check.name).availability()
        assert (check.available, check.reason) == (availability.available, availability.reason)
    assert {"python", "raysync", "ray", "torch", "tensordict", "nixl"} <= set(report.versions)


def _built_in() -> list[str]:
    """raysync's own transports (a test module may register a third party's here only)."""
    third_party = dict(registered_transports())
    return [name for name in known_transports() if name not in third_party]


def test_the_command_prints_each_transport_and_the_versions():
    result = subprocess.run(
        [sys.executable, "-m", "raysync", "doctor"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = check_this_process()
    built_in = [c for c in report.transports if c.name in _built_in()]
    expected = render([dataclasses.replace(report, transports=tuple(built_in))]).splitlines()
    # Every line but /dev/shm's free space (Ray's object stores live there too).
    assert [x for x in result.stdout.splitlines() if "/dev/shm" not in x] == [
        x for x in expected if "/dev/shm" not in x
    ]


def test_an_unknown_command_is_refused_with_the_usage():
    result = subprocess.run(
        [sys.executable, "-m", "raysync", "doctr"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "usage: python -m raysync {doctor}" in result.stderr

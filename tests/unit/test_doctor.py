"""``python -m raysync doctor`` in this process (no Ray): what it checks and prints."""

from __future__ import annotations

import platform
import subprocess
import sys

import ray
import torch

from raysync.doctor import check_this_process
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
    """What the command prints, checked against the packages and transports themselves
    (not against render's own text): a render that printed nothing, or dropped a
    transport or a reason, fails here."""
    result = subprocess.run(
        [sys.executable, "-m", "raysync", "doctor"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "== this process", result.stdout
    versions = lines[1].strip().split(", ")
    for package, version in (
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("ray", ray.__version__),
    ):
        assert f"{package} {version}" in versions, lines[1]
    assert lines[2].startswith("  cuda: ") and lines[3].startswith("  /dev/shm: "), lines
    # Then one line per built-in transport, in order: its name, then "ok" or why not.
    transports = lines[4:]
    assert [line.split()[0] for line in transports] == _built_in(), result.stdout
    for name, line in zip(_built_in(), transports, strict=True):
        availability = get_transport(name).availability()
        state = "ok" if availability.available else f"unavailable: {availability.reason}"
        assert line.split(maxsplit=1)[1] == state, line


def test_an_unknown_command_is_refused_with_the_usage():
    result = subprocess.run(
        [sys.executable, "-m", "raysync", "doctr"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "usage: python -m raysync {doctor}" in result.stderr

"""The examples run as a user runs them: a fresh interpreter with a Ray cluster of its own
(the session's cluster is this process's, so each runs in a subprocess), small sizes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).parents[1]


def test_demo_prints_a_row_per_transport_and_writes_its_chart(tmp_path):
    png = tmp_path / "demo.png"
    result = subprocess.run(
        [
            sys.executable,
            str(_ROOT / "examples" / "demo.py"),
            *("--transports", "object_store", "shared_memory"),
            *("--receivers", "1", "--broadcasts", "2", "--width", "64", "--layers", "2"),
            *("--png", str(png)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line}
    for transport in ("object_store", "shared_memory"):
        assert rows[transport][3:5] == ["yes", "0"], rows[transport]  # bitwise, no lag
    assert png.stat().st_size > 0

"""``examples/torchrl_collector.py`` runs as a user runs it (a fresh interpreter with a
Ray cluster of its own), at small sizes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_EXAMPLE = Path(__file__).parents[2] / "examples" / "torchrl_collector.py"


def test_the_collectors_act_with_the_weights_of_every_iteration(tmp_path):
    result = subprocess.run(
        [sys.executable, str(_EXAMPLE), "--collectors", "2", "--iterations", "3", "--frames", "16"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    rows = [line.split() for line in lines if line.split()[:1] in (["0"], ["1"], ["2"])]
    assert [row[1] for row in rows] == ["2", "3", "4"]  # a new version every iteration
    assert "collectors acted with the weights sent before each batch: True" in lines

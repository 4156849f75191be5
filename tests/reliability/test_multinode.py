"""Three simulated nodes: each broadcast crosses each node boundary once, not once per
receiver. The cluster runs in a subprocess, apart from the session's cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multinode


def test_object_store_copies_once_per_node():
    script = Path(__file__).with_name("multinode_relay.py")
    out = subprocess.run(
        [sys.executable, str(script), "object_store"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["acked"] == 6 and result["bitwise_equal"]
    nodes = {*result["receiver_nodes"], result["learner_node"]}
    assert len(nodes) == 3
    for copies in result["copies_per_broadcast"]:
        # One copy on the learner's node and one on each receiver node: 3 copies for 6
        # receivers, each node's receivers read their node's copy zero-copy.
        assert sorted(copies) == sorted(nodes), (copies, nodes)

"""Three simulated nodes: each version crosses each node boundary once, not once per
receiver, by the object store and by shared memory (relayed by one owner per node).

The cluster (a head and two worker nodes, ``ray.cluster_utils.Cluster``) cannot start
while this pytest process is connected to the session cluster of ``conftest.py``, so
``multinode_scenarios.py`` runs both scenarios in one cluster in a fresh interpreter,
once for this module, and reports what it observed; the tests here assert on that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.reliability.multinode_scenarios import RESULT_PREFIX

pytestmark = pytest.mark.multinode

_ROOT = Path(__file__).parents[2]
# Both below pytest's per-test timeout (pyproject), which counts the fixture's setup.
_SCENARIOS_TIMEOUT_S = 220
_SHUTDOWN_TIMEOUT_S = 45


@dataclass(frozen=True)
class ScenarioRun:
    results: dict  # scenario name -> {"facts": ..., "error"?: traceback}
    output: str  # the tails of the script's stdout and stderr

    def facts(self, scenario: str) -> dict:
        result = self.results[scenario]
        if "error" in result:
            pytest.fail(
                f"the {scenario} scenario raised:\n{result['error']}\n"
                f"facts so far: {result['facts']}\n{self.output}"
            )
        return result["facts"]


@pytest.fixture(scope="module")
def scenarios() -> ScenarioRun:
    returncode, stdout, stderr = run_script()
    output = f"stdout:\n{stdout[-6000:]}\nstderr:\n{stderr[-6000:]}"
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        pytest.fail(f"multinode_scenarios reported nothing (exit {returncode}):\n{output}")
    return ScenarioRun(json.loads(lines[-1].removeprefix(RESULT_PREFIX)), output)


def run_script() -> tuple[int, str, str]:
    """Exit status, stdout and stderr of the scenarios script. Past its deadline it gets
    SIGTERM (its ``finally`` shuts its cluster down), and SIGKILL only if that does not
    end it."""
    with subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.multinode_scenarios"],
        cwd=_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_DEDUP_LOGS": "0"},
    ) as script:
        try:
            stdout, stderr = script.communicate(timeout=_SCENARIOS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            script.terminate()
            try:
                stdout, stderr = script.communicate(timeout=_SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                script.kill()
                stdout, stderr = script.communicate()
            pytest.fail(
                f"multinode_scenarios did not finish in {_SCENARIOS_TIMEOUT_S} s:\n"
                f"stdout:\n{stdout[-6000:]}\nstderr:\n{stderr[-6000:]}"
            )
    return script.returncode, stdout, stderr


def test_object_store_copies_once_per_node(scenarios):
    facts = scenarios.facts("object_store")
    assert len(facts["receivers"]) == 6
    nodes = {*facts["receiver_nodes"], facts["learner_node"]}
    assert len(nodes) == 3
    assert len(facts["broadcasts"]) == 3
    for broadcast in facts["broadcasts"]:
        assert broadcast["acked"] == facts["receivers"]
        # One copy on the learner's node and one on each receiver node: 3 copies for 6
        # receivers, each node's receivers read their node's copy zero-copy.
        assert sorted(broadcast["object_on_nodes"]) == sorted(nodes), (broadcast, nodes)
    assert facts["not_bitwise_equal"] == {}


def test_shared_memory_relays_once_per_node_bitwise(scenarios):
    facts = scenarios.facts("shared_memory")
    assert facts["receivers"] == ["head-0", "node_a-0", "node_a-1", "node_b-0", "node_b-1"]
    assert [b["version"] for b in facts["broadcasts"]] == [1, 2]
    for broadcast in facts["broadcasts"]:
        assert broadcast["acked"] == facts["receivers"], broadcast
        assert broadcast["not_bitwise_equal"] == {}, broadcast
    # Two versions: the learner's node exported each once; each other node received
    # each once, however many receivers it has.
    owners = facts["owners_after_two_versions"]
    assert (owners["head"]["exports"], owners["head"]["relays"]) == (2, 0), owners
    for label in ("node_a", "node_b"):
        assert (owners[label]["exports"], owners[label]["relays"]) == (0, 2), owners


def test_shared_memory_late_joiner_and_puller_read_their_nodes_relay(scenarios):
    facts = scenarios.facts("shared_memory")
    # A late joiner on a node that holds the latest version reads it there: no transfer.
    late = facts["late_joiner"]
    assert (late["version"], late["not_bitwise_equal"]) == (2, {}), late
    assert late["node_a_relays"] == 2, late
    # Pull mode on another node gets a slot planned on its own node.
    puller = facts["puller"]
    assert (puller["pulled"], puller["not_bitwise_equal"]) == ({"policy": 3}, {}), puller
    assert puller["node_b_relays"] == 3, puller  # the pull reused version 3's relay


def test_shared_memory_owners_gone_after_close(scenarios):
    facts = scenarios.facts("shared_memory")
    assert facts["owners_alive_after_close"] == [], "owners still alive 30 s after close"


def test_shared_memory_goes_on_without_a_lost_node_and_drops_its_receivers(scenarios):
    facts = scenarios.facts("node_lost")
    assert facts["before"] == ["node_a-0", "node_c-0", "node_c-1"]
    # Each version after the loss reaches the receiver on the node that lives; the lost
    # ones fail (or are gone from the registry already), never the living one.
    for broadcast in facts["after"]:
        assert broadcast["acked"] == ["node_a-0"], broadcast
        assert set(broadcast["failed"]) <= {"node_c-0", "node_c-1"}, broadcast
    assert facts["not_bitwise_equal"] == {}
    assert facts["registered"] == ["node_a-0"]


def test_shared_memory_goes_on_past_a_stuck_receiver_on_another_node(scenarios):
    facts = scenarios.facts("stuck_receiver")
    assert facts["acked"][0] == ["node_a-0", "node_b-stuck"]
    for at, acked in enumerate(facts["acked"]):
        assert "node_a-0" in acked, (at + 1, facts["acked"])
    assert facts["not_bitwise_equal"] == {}


def test_shared_memory_goes_on_past_a_node_whose_relay_hangs(scenarios):
    facts = scenarios.facts("hung_relay")
    assert facts["first"] == ["node_a-0", "node_b-0"]
    hung = facts["hung"]
    assert hung["acked"] == ["node_a-0"] and list(hung["failed"]) == ["node_b-0"], hung
    why = hung["failed"]["node_b-0"]
    assert "the shared-memory owner on node" in why and "had not answered within" in why, why
    assert facts["after"] == {"acked": ["node_a-0", "node_b-0"], "failed": {}}
    assert facts["not_bitwise_equal"] == {}


def test_shared_memory_lets_go_of_a_receiver_that_registered_again_on_another_node(scenarios):
    facts = scenarios.facts("moved_receiver")
    assert "worker/mover" in facts["held_on_node_a"]  # its zero-copy model lived there
    assert "worker/mover" not in facts["held_on_node_a_after_move"], facts

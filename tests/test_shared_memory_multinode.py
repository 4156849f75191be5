"""Shared memory across simulated nodes: one object-store transfer per node, not per receiver.

The scenario needs a Ray cluster of its own (``ray.cluster_utils.Cluster``: a head and
two worker nodes on this machine), which cannot start while this pytest process is
connected to the session cluster of ``conftest.py``. So the test runs this module as a
script in a fresh interpreter; the script exits non-zero with the failed assertion.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCENARIO_TIMEOUT_S = 240


@pytest.mark.multinode
def test_relay_once_per_node_bitwise_and_late_join():
    result = subprocess.run(
        [sys.executable, "-m", "tests.test_shared_memory_multinode"],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        timeout=_SCENARIO_TIMEOUT_S,
        env={**os.environ, "RAY_DEDUP_LOGS": "0"},
    )
    assert result.returncode == 0, (
        f"multi-node scenario failed (exit {result.returncode}):\n"
        f"{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    )
    assert "SCENARIO OK" in result.stdout


def _scenario() -> None:
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from raysync import WeightHub
    from raysync.transports.shared_memory import OWNER_NAMESPACE, owner_name
    from tests.helpers import assert_same
    from tests.receivers import Collector, make_policy, state_of

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 8, "object_store_memory": 200 << 20},
    )
    nodes = {}
    for label in ("node_a", "node_b"):
        node = cluster.add_node(num_cpus=8, resources={label: 100}, object_store_memory=200 << 20)
        nodes[label] = node.node_id
    ray.init(address=cluster.address)
    try:
        cluster.wait_for_nodes()
        head = ray.get_runtime_context().get_node_id()
        hub = WeightHub.remote(transport="shared_memory")

        def collector(label: str, worker: str):
            return Collector.options(resources={label: 1}).remote(hub, worker_id=worker)

        receivers = {
            f"{label}-{i}": collector(label, f"{label}-{i}")
            for label in ("node_a", "node_b")
            for i in range(2)
        }
        receivers["head-0"] = Collector.remote(hub, worker_id="head-0")
        ray.get([r.__ray_ready__.remote() for r in receivers.values()])

        learner = make_policy()
        for version in (1, 2):
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(torch.randn_like(p))
            report = ray.get(hub.broadcast.remote(learner))
            assert report.version == version and report.acked == tuple(sorted(receivers)), report
            for r in receivers.values():
                assert_same(ray.get(r.state.remote()), state_of(learner))

        def stats(node_id: str):
            owner = ray.get_actor(owner_name(hub.config.hub_id, node_id), namespace=OWNER_NAMESPACE)
            return ray.get(owner.stats.remote())

        # Two versions: the learner's node exported each once; each other node received
        # each once, however many receivers it has.
        assert stats(head).exports == 2 and stats(head).relays == 0, stats(head)
        for label, node_id in nodes.items():
            assert stats(node_id).relays == 2 and stats(node_id).exports == 0, (
                label,
                stats(node_id),
            )

        # A late joiner on a node that holds the latest version reads it there: no transfer.
        late = collector("node_a", "node_a-late")
        assert ray.get(late.version.remote()) == 2
        assert_same(ray.get(late.state.remote()), state_of(learner))
        assert stats(nodes["node_a"]).relays == 2

        # Pull mode on another node gets a slot planned on its own node.
        puller = Collector.options(resources={"node_b": 1}).remote(
            hub, worker_id="puller", mode="pull"
        )
        ray.get(hub.broadcast.remote(learner))
        assert ray.get(puller.pull.remote()) == {"policy": 3}
        assert_same(ray.get(puller.state.remote()), state_of(learner))
        assert stats(nodes["node_b"]).relays == 3  # the pull reused version 3's relay

        ray.get(hub.close.remote())
        deadline = time.monotonic() + 30
        for node_id in (head, *nodes.values()):
            name = owner_name(hub.config.hub_id, node_id)
            while True:
                try:
                    ray.get_actor(name, namespace=OWNER_NAMESPACE)
                except ValueError:
                    break  # the owner is gone
                assert time.monotonic() < deadline, f"owner {name} still alive after close"
                time.sleep(0.2)
        print("SCENARIO OK")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    _scenario()

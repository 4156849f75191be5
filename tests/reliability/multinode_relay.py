"""Run as a script by test_multinode.py: a 3-node Ray cluster on this machine.

Prints one JSON line: which nodes hold a copy of each broadcast's object, and whether
every receiver ended bitwise equal to the learner.
"""

from __future__ import annotations

import json
import sys

import ray
import torch
from ray.cluster_utils import Cluster

from raysync import WeightHub, WeightReceiver


@ray.remote(num_cpus=0)
class NodeReceiver(WeightReceiver):
    def __init__(self, hub, name: str):
        self.model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        self.connect_hub(hub, {"m": "model"}, worker_id=name)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def main(transport: str) -> None:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "include_dashboard": False, "resources": {"head": 1}},
    )
    for name in ("node_a", "node_b"):
        cluster.add_node(num_cpus=4, resources={name: 100})
    ray.init(address=cluster.address)
    try:
        hub = WeightHub.options(resources={"head": 0.01}).remote(transport=transport)
        receivers = [
            NodeReceiver.options(resources={node: 1}).remote(hub, f"{node}-{i}")
            for node in ("node_a", "node_b")
            for i in range(3)
        ]
        ray.get([r.__ray_ready__.remote() for r in receivers])
        learner = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        copies = []
        for _ in range(3):
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(1.0)
            report = ray.get(hub.broadcast.remote(learner))
            update = ray.get(hub.latest.remote("m"))
            locations = ray.experimental.get_object_locations([update.payload.ref])
            copies.append(sorted(locations[update.payload.ref]["node_ids"]))
        expected = learner.state_dict()
        equal = all(
            all(torch.equal(v, expected[k]) for k, v in ray.get(r.state.remote()).items())
            for r in receivers
        )
        print(
            json.dumps(
                {
                    "acked": len(report.acked),
                    "copies_per_broadcast": copies,
                    "receiver_nodes": sorted({ray.get(r.node.remote()) for r in receivers}),
                    "learner_node": ray.get_runtime_context().get_node_id(),
                    "bitwise_equal": equal,
                    "bytes": report.bytes,
                }
            )
        )
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "object_store")

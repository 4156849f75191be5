"""Three simulated nodes (four for a while), one cluster for every scenario: what
crosses a node boundary once per node, and nodes that fail.

Run by ``test_multinode.py`` as a script in a fresh interpreter
(``python -m tests.reliability.multinode_scenarios`` from the repository root): it starts
a Ray cluster of its own (``ray.cluster_utils.Cluster``: a head and two worker nodes on
this machine), which cannot start while the pytest process is connected to the session
cluster of ``conftest.py``. Starting one costs several seconds on two cores, so every
scenario runs in this one cluster, one after the other:

- ``object_store``: 6 receivers on the two worker nodes; after each of 3 broadcasts the
  version's object is on exactly 3 nodes (the learner's and one per receiver node: Ray's
  object manager pulls it once per node, that node's receivers map it), and every
  receiver ends bit for bit equal to the learner.
- ``shared_memory``: 2 receivers on each worker node and 1 on the head. Each version is
  exported once by the learner's node's owner and relayed once into each other node,
  however many receivers that node has; every receiver holds it bit for bit. A late
  joiner on a node that holds the latest version reads it there (no new relay); a pull
  receiver on another node reuses that node's relay; after ``close`` every owner is gone.
- ``stuck_receiver`` (shared memory): a receiver on node_b never finishes applying; the
  one on node_a receives all 7 versions.
- ``moved_receiver`` (shared memory): a zero-copy receiver on node_a dies and registers
  again from node_b: node_a's owner lets its hold go.
- ``hung_relay`` (shared memory): node_b's owner hangs reading the exported version;
  the receiver on node_a gets the version, node_b's fails saying why, and both get
  the next one once node_b reads again.
- ``node_lost`` (shared memory): a third worker node with two receivers is removed
  after a broadcast; the next versions reach the receiver on another node, and the
  lost ones are dropped.

The script asserts nothing: it prints one line, ``SCENARIOS <json>``, with what each
scenario observed (``facts``) and, if a scenario raised, the traceback (``error``), and the
test module asserts on those facts, so a failure there shows the values. It exits 1 if a
scenario raised. The cluster is shut down however the script ends short of SIGKILL: Ray
turns SIGTERM (which the test sends past its deadline) into ``SystemExit``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
import traceback
from collections.abc import Callable

import ray
import torch
from ray.cluster_utils import Cluster

from raysync import WeightHub
from raysync.testing import assert_bitwise
from raysync.transports.shared_memory import OWNER_NAMESPACE, owner_name
from tests.helpers import Gate
from tests.receivers import (
    Collector,
    SlowHook,
    hang_relay_reads,
    make_policy,
    make_probe_model,
    state_of,
)

RESULT_PREFIX = "SCENARIOS "
WORKER_NODES = ("node_a", "node_b")
_NODE_ARGS = {
    "num_cpus": 4,  # every actor here (receivers, hubs, owners) asks for 0 CPUs
    "object_store_memory": 200 << 20,  # many times the few versions of 8 MB or less kept
}
# 8 MB a version: large enough to live in the object store rather than inline in replies.
_object_store_model = functools.partial(make_probe_model, width=512, layers=8)
_OWNERS_GONE_TIMEOUT_S = 30


def main() -> int:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**_NODE_ARGS, "include_dashboard": False, "resources": {"head": 1}},
    )
    try:
        nodes = {
            label: cluster.add_node(**_NODE_ARGS, resources={label: 100}).node_id
            for label in WORKER_NODES
        }
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        nodes["head"] = ray.get_runtime_context().get_node_id()  # the learner's node
        results = {
            "object_store": run(object_store_copies_once_per_node, nodes),
            "shared_memory": run(shared_memory_relays_once_per_node, nodes),
            "stuck_receiver": run(shared_memory_goes_on_past_a_stuck_receiver, nodes),
            "moved_receiver": run(shared_memory_lets_a_moved_receivers_holds_go, nodes),
            "hung_relay": run(shared_memory_goes_on_past_a_hung_relay, nodes),
            # Last: it adds a node and removes it.
            "node_lost": run(functools.partial(shared_memory_survives_a_lost_node, cluster), nodes),
        }
        print(RESULT_PREFIX + json.dumps(results), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 1 if any("error" in result for result in results.values()) else 0


def run(scenario: Callable[[dict[str, str], dict], None], nodes: dict[str, str]) -> dict:
    """``scenario``'s facts, and its traceback if it raised (with the facts gathered so far)."""
    facts: dict = {}
    try:
        scenario(nodes, facts)
    except Exception:
        return {"facts": facts, "error": traceback.format_exc()}
    return {"facts": facts}


def object_store_copies_once_per_node(nodes: dict[str, str], facts: dict) -> None:
    hub = WeightHub.options(resources={"head": 0.01}).remote(transport="object_store")
    receivers = {
        name: on_node(label, hub, name, model_factory=_object_store_model)
        for label in WORKER_NODES
        for name in (f"{label}-{i}" for i in range(3))
    }
    try:
        ray.get([r.__ray_ready__.remote() for r in receivers.values()])
        facts["receivers"] = sorted(receivers)
        facts["learner_node"] = nodes["head"]
        facts["receiver_nodes"] = sorted({node_of(r) for r in receivers.values()})
        facts["broadcasts"] = []
        learner = _object_store_model()
        for _ in range(3):
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(1.0)
            report = ray.get(hub.broadcast.remote(learner))
            update = ray.get(hub.latest.remote("policy"))
            locations = ray.experimental.get_object_locations(list(update.payload.refs))
            facts["broadcasts"].append(
                {
                    "acked": list(report.acked),
                    "object_on_nodes": sorted(
                        {node for ref in update.payload.refs for node in locations[ref]["node_ids"]}
                    ),
                }
            )
        facts["not_bitwise_equal"] = not_bitwise_equal(receivers, state_of(learner))
    finally:
        for actor in (hub.actor, *receivers.values()):
            ray.kill(actor)


def shared_memory_relays_once_per_node(nodes: dict[str, str], facts: dict) -> None:
    hub = WeightHub.remote(transport="shared_memory")
    receivers = {
        name: on_node(label, hub, name)
        for label in WORKER_NODES
        for name in (f"{label}-{i}" for i in range(2))
    }
    receivers["head-0"] = Collector.remote(hub, worker_id="head-0")
    ray.get([r.__ray_ready__.remote() for r in receivers.values()])
    facts["receivers"] = sorted(receivers)

    def owner_stats(label: str) -> dict:
        owner = ray.get_actor(
            owner_name(hub.config.hub_id, nodes[label]), namespace=OWNER_NAMESPACE
        )
        return dataclasses.asdict(ray.get(owner.stats.remote()))

    learner = make_policy()
    facts["broadcasts"] = []
    for _ in range(2):
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(torch.randn_like(p))
        report = ray.get(hub.broadcast.remote(learner))
        facts["broadcasts"].append(
            {
                "version": report.version,
                "acked": list(report.acked),
                "not_bitwise_equal": not_bitwise_equal(receivers, state_of(learner)),
            }
        )
    facts["owners_after_two_versions"] = {label: owner_stats(label) for label in nodes}

    late = on_node("node_a", hub, "node_a-late")
    facts["late_joiner"] = {
        "version": ray.get(late.version.remote()),
        "not_bitwise_equal": not_bitwise_equal({"node_a-late": late}, state_of(learner)),
        "node_a_relays": owner_stats("node_a")["relays"],
    }

    puller = on_node("node_b", hub, "puller", mode="pull")
    ray.get(hub.broadcast.remote(learner))
    facts["puller"] = {
        "pulled": ray.get(puller.pull.remote()),
        "not_bitwise_equal": not_bitwise_equal({"puller": puller}, state_of(learner)),
        "node_b_relays": owner_stats("node_b")["relays"],
    }

    ray.get(hub.close.remote())
    owners = [owner_name(hub.config.hub_id, node_id) for node_id in nodes.values()]
    facts["owners_alive_after_close"] = owners_still_alive(owners, _OWNERS_GONE_TIMEOUT_S)


def shared_memory_goes_on_past_a_stuck_receiver(nodes: dict[str, str], facts: dict) -> None:
    """A receiver on node_b stops at version 2 (its hook never returns): its node's
    slots fill with the versions held for it and its node's relays wait for a slot.
    The receiver on node_a must receive every version all along (the plan once waited
    for every node's relay, past the broadcast's timeout: node_a's receiver failed)."""
    hub = WeightHub.options(resources={"head": 0.01}).remote(transport="shared_memory")
    healthy = on_node("node_a", hub, "node_a-0")
    stuck = SlowHook.options(resources={"node_b": 1}).remote(
        hub, delay_s=600, worker_id="node_b-stuck"
    )
    try:
        ray.get([healthy.__ray_ready__.remote(), stuck.__ray_ready__.remote()])
        learner = make_policy()
        facts["acked"] = []
        for _ in range(_STUCK_BROADCASTS):
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(torch.randn_like(p))
            report = ray.get(
                hub.broadcast.remote(learner, raise_on_failure=False, timeout_s=_STUCK_TIMEOUT_S)
            )
            facts["acked"].append(list(report.acked))
        facts["not_bitwise_equal"] = not_bitwise_equal({"node_a-0": healthy}, state_of(learner))
    finally:
        ray.kill(stuck)
        ray.get(hub.close.remote())


def shared_memory_lets_a_moved_receivers_holds_go(nodes: dict[str, str], facts: dict) -> None:
    """A zero-copy receiver on node_a (its model lives in node_a's relay slot, held for
    it) dies and its worker id registers again from node_b: node_a's owner must let the
    old hold go (left, each move pinned one of its slots for good)."""
    hub = WeightHub.options(resources={"head": 0.01}).remote(transport="shared_memory")
    name = owner_name(hub.config.hub_id, nodes["node_a"])
    mover = on_node("node_a", hub, "mover", zero_copy=True)
    try:
        ray.get(mover.__ray_ready__.remote())
        ray.get(hub.broadcast.remote(make_policy()))
        node_a = ray.get_actor(name, namespace=OWNER_NAMESPACE)
        facts["held_on_node_a"] = list(ray.get(node_a.stats.remote()).holds)
        ray.kill(mover)
        mover = on_node("node_b", hub, "mover", zero_copy=True)
        ray.get(mover.__ray_ready__.remote())
        deadline = time.monotonic() + _OWNERS_GONE_TIMEOUT_S
        while "worker/mover" in (holds := ray.get(node_a.stats.remote()).holds):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)  # polling the owner: nothing to wait on
        facts["held_on_node_a_after_move"] = list(holds)
    finally:
        ray.kill(mover)
        ray.get(hub.close.remote())


def shared_memory_goes_on_past_a_hung_relay(nodes: dict[str, str], facts: dict) -> None:
    """node_b's owner hangs reading the exported version (its relay never answers): the
    receiver on node_a gets the version all the same and node_b's fails, saying why
    (the plan waited for every node's relay, past the broadcast's timeout: node_a's
    receiver failed too). Once node_b's reads go again, both get the next version."""
    hub = WeightHub.options(resources={"head": 0.01}).remote(transport="shared_memory")
    healthy, hung = on_node("node_a", hub, "node_a-0"), on_node("node_b", hub, "node_b-0")
    gate = Gate.options(resources={"head": 0.01}).remote()
    try:
        ray.get([healthy.__ray_ready__.remote(), hung.__ray_ready__.remote()])
        learner = make_policy()
        facts["first"] = list(ray.get(hub.broadcast.remote(learner)).acked)
        name = owner_name(hub.config.hub_id, nodes["node_b"])
        node_b = ray.get_actor(name, namespace=OWNER_NAMESPACE)
        ray.get(node_b.__ray_call__.remote(hang_relay_reads, gate))
        for phase, timeout_s in (("hung", _HUNG_TIMEOUT_S), ("after", 60.0)):
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(torch.randn_like(p))
            report = ray.get(
                hub.broadcast.remote(learner, raise_on_failure=False, timeout_s=timeout_s)
            )
            facts[phase] = {"acked": list(report.acked), "failed": report.failed}
            ray.get(gate.open.remote())
        receivers = {"node_a-0": healthy, "node_b-0": hung}
        facts["not_bitwise_equal"] = not_bitwise_equal(receivers, state_of(learner))
    finally:
        ray.get(gate.open.remote())
        ray.get(hub.close.remote())


_HUNG_TIMEOUT_S = 4.0

#: Enough versions to fill node_b's slots (4) with the stuck receiver's holds, and two more
#: (each waits out the stuck receiver's timeout: the scenario's time is mostly these waits).
_STUCK_BROADCASTS = 7
_STUCK_TIMEOUT_S = 4.0


def shared_memory_survives_a_lost_node(
    cluster: Cluster, nodes: dict[str, str], facts: dict
) -> None:
    """A node with receivers is removed: the receivers elsewhere go on receiving every
    version, those of the lost node fail (they are not called: no owner can run there)
    and are dropped from the hub's registry."""
    lost = cluster.add_node(**_NODE_ARGS, resources={"node_c": 100})
    cluster.wait_for_nodes()
    hub = WeightHub.options(resources={"head": 0.01}).remote(transport="shared_memory")
    receivers = {name: on_node(label, hub, name) for label, name in _LOST_NODE_RECEIVERS}
    ray.get([r.__ray_ready__.remote() for r in receivers.values()])
    learner = make_policy()
    facts["before"] = list(ray.get(hub.broadcast.remote(learner)).acked)
    cluster.remove_node(lost)
    facts["after"] = []
    for _ in range(3):
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(torch.randn_like(p))
        report = ray.get(hub.broadcast.remote(learner, raise_on_failure=False, timeout_s=60))
        facts["after"].append({"acked": list(report.acked), "failed": sorted(report.failed)})
    kept = {"node_a-0": receivers["node_a-0"]}
    facts["not_bitwise_equal"] = not_bitwise_equal(kept, state_of(learner))
    facts["registered"] = registered_once_lost_gone(hub, _OWNERS_GONE_TIMEOUT_S)
    ray.get(hub.close.remote())


_LOST_NODE_RECEIVERS = (("node_a", "node_a-0"), ("node_c", "node_c-0"), ("node_c", "node_c-1"))


def registered_once_lost_gone(hub, timeout_s: float) -> list[str]:
    """The workers ``hub`` lists once none of the lost node's is left, or once
    ``timeout_s`` has passed (polled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = sorted(r.worker for r in ray.get(hub.status.remote()).receivers)
        if not any(w.startswith("node_c") for w in workers) or time.monotonic() >= deadline:
            return workers
        time.sleep(0.2)


def on_node(label: str, hub, worker_id: str, **collector_args):
    """A Collector pinned to the node with custom resource ``label``."""
    return Collector.options(resources={label: 1}).remote(
        hub, worker_id=worker_id, **collector_args
    )


def node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))


def not_bitwise_equal(receivers: dict, expected: dict[str, torch.Tensor]) -> dict[str, str]:
    """The receivers whose state is not ``expected`` bit for bit, each with what differs."""
    differing = {}
    for name, receiver in receivers.items():
        try:
            assert_bitwise(ray.get(receiver.state.remote()), expected)
        except AssertionError as err:
            differing[name] = str(err)
    return differing


def owners_still_alive(names: list[str], timeout_s: float) -> list[str]:
    """The named owner actors still alive once ``timeout_s`` has passed (polled)."""
    deadline = time.monotonic() + timeout_s
    alive = names
    while True:
        alive = [name for name in alive if is_alive(name)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.2)


def is_alive(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=OWNER_NAMESPACE)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())

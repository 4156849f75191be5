"""Real faults: kill receivers, the hub and the learner; nothing is lost, nothing hangs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.experimental import internal_kv

import raysync
from raysync import BroadcastError, HubNotFoundError, HubSnapshotError, WeightReceiver
from raysync.hub_snapshot import KV_NAMESPACE
from raysync.transports import DEFAULT_TRANSPORT, get_transport
from tests.helpers import (
    assert_same,
    fail_snapshot_writes,
    ready,
    start,
    start_hub,
    transport_params,
    wait_dead,
    wait_for_file,
    wait_until,
)
from tests.receivers import Collector, RegistersAsTheHubDies, beat_now, make_policy, state_of

HEARTBEAT_S = 0.3


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Restartable(WeightReceiver):
    """With ``stall_dir``, an update whose ``<stall_dir>/stall-<name>`` file exists stalls
    in the receiver's update path after touching ``<stall_dir>/inside-<name>``, so the
    test kills it mid-broadcast (the file outlives the process: the restarted
    incarnation stalls too until the test removes it)."""

    def __init__(self, hub, name: str, stall_dir: str | None = None):
        self.policy = make_policy()
        self.name = name
        self.stall_dir = stall_dir
        self.connect_hub(hub, models={"policy": "policy"}, worker_id=name, heartbeat_s=HEARTBEAT_S)

    def on_weights_applied(self, model: str, version: int) -> None:
        if self.stall_dir is None:
            return
        stall = Path(self.stall_dir, f"stall-{self.name}")
        if stall.exists():
            Path(self.stall_dir, f"inside-{self.name}").touch()
            while stall.exists():
                time.sleep(0.01)

    def state(self) -> dict[str, torch.Tensor]:
        return state_of(self.policy)

    def version(self) -> int:
        return self.weights_version()


@ray.remote(num_cpus=0)
class Learner:
    """A learner in its own process, so that it can be killed."""

    def __init__(self, hub):
        self.hub = hub
        self.policy = make_policy()

    def step(self, seed: int) -> int:
        torch.manual_seed(seed)
        self.policy = make_policy()
        return ray.get(self.hub.broadcast.remote(self.policy)).version

    def weights(self) -> dict[str, torch.Tensor]:
        return state_of(self.policy)

    def many(self, count: int, seed: int) -> list[int]:
        torch.manual_seed(seed)
        refs = [self.hub.broadcast.remote(make_policy(), wait=False) for _ in range(count)]
        return [t.version for t in ray.get(refs)]


@pytest.mark.slow  # CI kills one victim per moment and transport (test_kill_moments.py)
@pytest.mark.parametrize("transport", transport_params())
def test_rotating_victim_killed_mid_broadcast_20_times(actors, transport, tmp_path):
    hub = start_hub(actors, transport)
    receivers = [start(actors, Restartable, hub, f"r{i}", str(tmp_path)) for i in range(3)]
    ready(receivers)
    ray.get(hub.broadcast.remote(make_policy()))
    for round_ in range(20):
        victim = round_ % 3
        stall, inside = tmp_path / f"stall-r{victim}", tmp_path / f"inside-r{victim}"
        stall.touch()
        learner = make_policy()
        ref = hub.broadcast.remote(learner, timeout_s=30, raise_on_failure=False)
        wait_for_file(inside)  # the victim is inside its update: the kill lands mid-broadcast
        ray.kill(receivers[victim], no_restart=False)
        report = ray.get(ref, timeout=60)  # the stall outlives the kill: it cannot ack
        stall.unlink()  # let the restarted incarnation apply the latest version
        survivors = [f"r{i}" for i in range(3) if i != victim]
        assert report.acked == tuple(survivors), report
        assert set(report.failed) == {f"r{victim}"}
        assert "died" in report.failed[f"r{victim}"]
        assert "Restartable" in report.failed[f"r{victim}"]
        for i in range(3):
            if i != victim:
                assert_same(ray.get(receivers[i].state.remote()), state_of(learner))
        # Restarted by Ray, it registered again from __init__ and holds the latest version,
        # without anyone calling it for that.
        assert ray.get(receivers[victim].version.remote(), timeout=60) == report.version
        assert_same(ray.get(receivers[victim].state.remote()), state_of(learner))
        inside.unlink()  # touched again by the restarted incarnation's first apply


def test_hub_restart_receivers_reattach_versions_never_go_back(actors, transport):
    hub = start_hub(
        actors, transport, {"name": "restarting-hub", "max_restarts": 2, "max_task_retries": 0}
    )
    receivers = [start(actors, Restartable, "restarting-hub", f"r{i}") for i in range(2)]
    ready(receivers)
    for _ in range(3):
        ray.get(hub.broadcast.remote(make_policy()))
    first_boot = ray.get(hub.status.remote()).boot_id
    ray.kill(hub.actor, no_restart=False)
    # Receivers notice the new incarnation does not know them and register again.
    deadline = time.monotonic() + 60
    while True:
        try:
            status = ray.get(hub.status.remote(), timeout=10)
            restarted = status.boot_id != first_boot
            if restarted and {r.worker for r in status.receivers} == {"r0", "r1"}:
                break
        except ray.exceptions.RayActorError:
            pass  # still restarting
        assert time.monotonic() < deadline, "receivers did not re-register within 60 s"
        time.sleep(0.2)
    assert status.versions == {"policy": 3}  # restored, not reset to 0
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner))
    assert report.version == 4 and report.acked == ("r0", "r1")
    for r in receivers:
        assert ray.get(r.version.remote()) == 4
        assert_same(ray.get(r.state.remote()), state_of(learner))


def test_only_a_hub_ray_may_restart_keeps_a_snapshot(actors):
    """A snapshot is a GCS write per version on the hub's event loop: a hub without
    ``max_restarts`` has no incarnation to read it, and writes none."""
    once = start_hub(actors, DEFAULT_TRANSPORT, models=["m"])
    restartable = start_hub(actors, DEFAULT_TRANSPORT, {"max_restarts": 1}, models=["m"])
    for hub in (once, restartable):
        assert ray.get(hub.broadcast.remote({"w": torch.ones(4)}, model="m")).version == 1

    def saved(hub) -> list:
        prefix = f"hub/{hub.actor._actor_id.hex()}/"
        return internal_kv._internal_kv_list(prefix, namespace=KV_NAMESPACE)

    assert saved(once) == []
    assert sorted(saved(restartable)) == [
        f"hub/{restartable.actor._actor_id.hex()}/{key}".encode()
        for key in ("spec/m", "transports", "versions")
    ]


def test_a_version_the_hub_cannot_save_is_refused_and_published_nowhere(actors):
    """A restartable hub saves each version to the GCS, where its next incarnation
    reads them back, before publishing it: a version it could not save is refused and
    not published (a pull does not get it; published, a restart would number another
    one the same); the next broadcast reaches every receiver."""
    hub = start_hub(actors, DEFAULT_TRANSPORT, {"max_restarts": 1})
    collector = start(actors, Collector, hub, worker_id="c0")
    ready([collector])
    assert ray.get(hub.broadcast.remote(make_policy())).version == 1
    ray.get(hub.actor.__ray_call__.remote(fail_snapshot_writes, True))
    with pytest.raises(HubSnapshotError, match=r"version 2 of model 'policy'.*GCS is unreachable"):
        ray.get(hub.broadcast.remote(make_policy()))
    assert ray.get(hub.latest.remote("policy")).version == 1
    ray.get(hub.actor.__ray_call__.remote(fail_snapshot_writes, False))
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner))
    assert report.acked == ("c0",)
    assert ray.get(hub.latest.remote("policy")).version == report.version
    assert ray.get(collector.version.remote()) == report.version
    assert_same(ray.get(collector.state.remote()), state_of(learner))


def test_learner_dies_receivers_keep_last_good_version(actors, transport):
    """The learner dies between versions, and with it what it put or registered (the
    object of its version, its NIXL buffers): a receiver keeps the version it applied;
    one that joins meanwhile gets in (with that version where its bytes outlive the
    learner, as a node's segment does, else none); a new learner brings both up."""
    hub = start_hub(actors, transport)
    collector = start(actors, Collector, hub)
    ready([collector])
    learner = start(actors, Learner, hub)
    assert ray.get(learner.step.remote(1)) == 1
    expected = ray.get(learner.weights.remote())
    ray.kill(learner)
    wait_dead(learner)
    assert ray.get(collector.version.remote()) == 1
    assert_same(ray.get(collector.state.remote()), expected)
    late = start(actors, Collector, hub, worker_id="late")
    ready([late])
    if ray.get(late.version.remote()) == 1:
        assert_same(ray.get(late.state.remote()), expected)
    else:
        assert ray.get(late.version.remote()) == 0
    # A new learner takes over; versions continue, above the number the dead learner's
    # last report routed it where it delivers itself (it may have delivered it).
    successor = start(actors, Learner, hub)
    after_routed = 3 if get_transport(transport).learner_delivers else 2
    assert ray.get(successor.step.remote(2)) == after_routed
    for receiver in (collector, late):
        assert ray.get(receiver.version.remote()) == after_routed
        assert_same(ray.get(receiver.state.remote()), ray.get(successor.weights.remote()))


@pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # the hub orders versions
def test_two_learners_at_once_versions_totally_ordered(actors, transport):
    hub = start_hub(actors, transport)
    collectors = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(2)]
    ready(collectors)
    learners = [start(actors, Learner, hub) for _ in range(2)]
    ready(learners)
    versions = ray.get([learner.many.remote(10, seed) for seed, learner in enumerate(learners)])
    # A number each; a number one learner was routed and the other's overtook is skipped
    # (tests/test_direct_path.py checks no number ever names two weights).
    assert all(v == sorted(set(v)) for v in versions)
    assert len(set(versions[0] + versions[1])) == 20
    last = ray.get(hub.wait_for.remote(ray.get(hub.broadcast.remote(make_policy(), wait=False))))
    assert last.version > max(versions[0] + versions[1])
    for c in collectors:
        assert ray.get(c.version.remote()) == last.version


def test_connect_to_missing_hub_fails_within_its_timeout(ray_cluster, actors):
    @ray.remote(num_cpus=0)
    class Lonely(WeightReceiver):
        def __init__(self):
            self.policy = make_policy()
            self.connect_hub("no-such-hub", "policy", timeout_s=1.0)

        def ping(self) -> str:
            return "pong"

    lonely = start(actors, Lonely)
    with pytest.raises(ray.exceptions.RayActorError) as info:
        ray.get(lonely.ping.remote(), timeout=60)
    assert HubNotFoundError.__name__ in str(info.value) and "no-such-hub" in str(info.value)
    assert "appeared within 1 s" in str(info.value)  # its own timeout, not a default


# The learner's first step is a call to the hub: no transport is reached when it is dead.
@pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])
def test_dead_hub_makes_broadcast_fail_not_hang(actors, transport):
    hub = start_hub(actors, transport)
    collector = start(actors, Collector, hub)
    ready([collector])
    ray.kill(hub.actor)
    wait_dead(hub.actor)  # a call sent before the kill lands may still be answered
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(hub.broadcast.remote(make_policy()), timeout=60)
    assert ray.get(collector.version.remote()) == 0  # it keeps serving


def test_no_new_cluster_from_handles_collected_after_shutdown():
    """A hub handle garbage-collected after ray.shutdown() must not start a new cluster."""
    script = textwrap.dedent(
        """
        import gc, ray, torch
        from raysync import WeightHub
        ray.init(address="local", num_cpus=2, include_dashboard=False)
        hub = WeightHub.remote(models=["m"])
        ref = hub.broadcast.remote({"w": torch.zeros(4)}, model="m")
        ray.get(ref)
        ray.shutdown()
        del hub, ref
        gc.collect()
        print("initialized after shutdown:", ray.is_initialized())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=True
    )
    assert "initialized after shutdown: False" in out.stdout, out.stdout + out.stderr


# Hub logic; the conformance kit checks a dead receiver's failure on every transport.
@pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])
def test_failure_report_raises_by_default(actors, transport):
    hub = start_hub(actors, transport)
    victim = start(actors, Collector, hub, worker_id="victim")
    ready([victim])
    ray.kill(victim)
    wait_dead(victim)  # else the broadcast's call may still reach it
    with pytest.raises(BroadcastError, match="victim"):
        ray.get(hub.broadcast.remote(make_policy(), timeout_s=10))


def kill_and_wait_for_its_restart(hub) -> None:
    """Kill the hub's process and return once Ray's new incarnation answers."""
    first_boot = ray.get(hub.status.remote()).boot_id
    ray.kill(hub.actor, no_restart=False)

    def restarted() -> bool:
        try:
            return ray.get(hub.status.remote(), timeout=10).boot_id != first_boot
        except ray.exceptions.RayActorError:
            return False  # still restarting

    wait_until(restarted, timeout_s=60, what="the hub's restart")


@ray.remote(num_cpus=0)
class _LearnerWhoseHubDies:
    """A learner process that has not broadcast yet (its first broadcast asks the hub for
    its route), and whose hub dies as it asks."""

    def broadcast_as_the_hub_dies(self, hub, hub_pid: int, weights) -> object:
        """Freeze the hub's process, broadcast, and kill the hub once the route is asked
        (the ask is then in flight: Ray fails it, and restarts the hub). The report."""
        import signal

        from raysync.hub_handle import HubHandle

        ask = HubHandle._ask_route

        def ask_and_kill_the_hub(handle, *args):
            asked = ask(handle, *args)
            HubHandle._ask_route = ask  # once: the restarted hub answers
            os.kill(hub_pid, signal.SIGKILL)
            return asked

        os.kill(hub_pid, signal.SIGSTOP)
        HubHandle._ask_route = ask_and_kill_the_hub
        return ray.get(hub.broadcast.remote(weights, timeout_s=60))


def test_a_broadcast_whose_route_ask_the_hub_dies_with_asks_its_restart(actors):
    """A learner whose route ask was in flight as the hub died got Ray's
    ``ActorUnavailableError`` from ``broadcast.remote()`` itself, before anything was
    sent (a loop that handles failures at ``ray.get`` of the ack crashed). It asks the
    new incarnation, within the broadcast's timeout, and the version lands."""
    hub = start_hub(actors, DEFAULT_TRANSPORT, {"max_restarts": 1, "max_task_retries": 0})
    collector = start(actors, Collector, hub, worker_id="c")
    learner = start(actors, _LearnerWhoseHubDies)
    ready([collector, learner])
    ray.get(hub.broadcast.remote(make_policy()))
    hub_pid = ray.get(hub.actor.__ray_call__.remote(lambda h: os.getpid()))
    weights = make_policy()
    report = ray.get(learner.broadcast_as_the_hub_dies.remote(hub, hub_pid, weights))
    assert report.version == 2, report
    # Registered again (a heartbeat), the collector holds it: from the broadcast, or from
    # its welcome if it registered after the broadcast's targets were taken.
    wait_until(
        lambda: ray.get(collector.version.remote()) == 2, timeout_s=60, what="version 2"
    )
    assert_same(ray.get(collector.state.remote()), state_of(weights))


def test_a_receiver_registering_as_the_hub_dies_registers_with_its_restart(actors):
    """The registration call in flight as the hub died raised Ray's
    ``ActorUnavailableError`` out of ``connect_hub``, so out of the receiver's
    ``__init__``: Ray took the actor for dead for good, whatever its ``max_restarts``
    (a receiver Ray restarted while the hub restarted too, 1 in 5 kills in a soak). It
    asks the new incarnation, within ``connect_hub``'s timeout."""
    hub = start_hub(
        actors, DEFAULT_TRANSPORT, {"max_restarts": 1, "max_task_retries": 0}, models=["policy"]
    )
    ray.get(hub.broadcast.remote(make_policy(), model="policy"))
    hub_pid = ray.get(hub.actor.__ray_call__.remote(lambda h: os.getpid()))
    joiner = start(actors, RegistersAsTheHubDies, hub, hub_pid)
    ready([joiner])
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner), timeout=60)
    assert (report.version, report.acked) == (2, ("joiner",))
    assert ray.get(joiner.version.remote()) == 2
    assert_same(ray.get(joiner.state.remote()), state_of(learner))


def test_a_pull_receiver_without_a_watch_is_known_again_after_a_restart_before_any_broadcast(
    actors,
):
    """The hub restarted before its first broadcast: its snapshot (written by
    broadcasts) knows no model. A pull asked it for the latest of a model it did not
    know, and was refused as such on every pull: only a hub that did not know the
    worker made the receiver register again, and the learner's broadcast of the model
    found no receiver of it. The hub asks who pulls first."""
    hub = start_hub(actors, DEFAULT_TRANSPORT, {"max_restarts": 1, "max_task_retries": 0})
    mine = make_policy()
    receiver = raysync.attach(hub, {"policy": mine}, mode="pull", heartbeat_s=None)
    try:
        kill_and_wait_for_its_restart(hub)
        assert receiver.pull() == {"policy": 0}
        assert [r.worker for r in ray.get(hub.status.remote()).receivers] == [receiver.worker]
        learner = make_policy()
        ray.get(hub.broadcast.remote(learner, model="policy"))
        assert receiver.pull() == {"policy": 1}
        assert_same(state_of(mine), state_of(learner))
    finally:
        receiver.close()


def test_waiting_for_a_report_lost_with_a_restarted_hub_says_so(actors):
    """A ``wait=False`` ticket from before the hub restarted: its report died with that
    incarnation, and ``wait_for`` said the version was "unknown or older than the last
    256 broadcasts", which sent users looking for the wrong cause."""
    hub = start_hub(actors, DEFAULT_TRANSPORT, {"max_restarts": 1, "max_task_retries": 0})
    collector = start(actors, Collector, hub, worker_id="c")
    ready([collector])
    ticket = ray.get(hub.broadcast.remote(make_policy(), wait=False))
    assert ray.get(hub.wait_for.remote(ticket)).acked == ("c",)
    kill_and_wait_for_its_restart(hub)
    with pytest.raises(KeyError, match="the hub restarted since"):
        ray.get(hub.wait_for.remote(ticket))


def test_a_broadcast_in_flight_as_the_hub_dies_is_not_run_again_by_its_restart(actors):
    """A hub started with ``max_task_retries``: Ray ran the learner's submit in flight
    again on the restarted incarnation, which knows nothing of the learner's later
    broadcasts and published those weights as its newest version (older than what
    receivers held, had a later broadcast been versioned before the death). The
    learner hears that the hub died instead, and the restored version stays."""
    from tests.receivers import Holder
    from tests.signals import Gate

    hub = start_hub(actors, DEFAULT_TRANSPORT, {"max_restarts": 1, "max_task_retries": -1})
    holder = start(actors, Holder, hub, state_of(make_policy()), "busy", "policy")
    ready([holder])
    ray.get(hub.broadcast.remote(make_policy()))
    entered, gate = Gate.remote(), Gate.remote()
    actors.extend([entered, gate])
    holding = holder.hold.remote(gate, entered)
    ray.get(entered.wait.remote())  # its delivery now waits behind the method
    in_flight = hub.broadcast.remote(make_policy(), timeout_s=30)
    first = ray.get(hub.status.remote())  # called after the submit: that one has begun
    ray.kill(hub.actor, no_restart=False)
    ray.get(gate.open.remote())
    ray.get(holding)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(in_flight, timeout=60)

    def back_with_the_holder() -> bool:
        try:
            status = ray.get(hub.status.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return False  # still restarting
        return status.boot_id != first.boot_id and [r.worker for r in status.receivers] == [
            "busy"
        ]

    wait_until(back_with_the_holder, timeout_s=60, what="the hub's restart and re-registration")
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner), timeout=60)
    assert report.acked == ("busy",)
    assert_same(ray.get(holder.state.remote()), state_of(learner))


@pytest.mark.parametrize("published", [0, 1])
def test_a_restarted_hub_hands_versions_to_transports_read_since_its_last_one(
    actors, published
):
    """A receiver came to read by ``shared_memory`` after the hub's last version (or
    before any): the hub saved which transports its receivers read by only with a
    version, so its restarted incarnation, asked for a route by a learner with none,
    had the version handed over to the hub's transport alone, and the receiver, back,
    was offered nothing it could read (the learner's last broadcast: never the latest).
    A registration now saves what is new to the snapshot."""
    name = f"restarted-hub-read-since-{published}"
    hub = start_hub(
        actors,
        DEFAULT_TRANSPORT,
        {"name": name, "max_restarts": 1, "max_task_retries": 0},
        models=["policy"],  # the collectors'
    )
    for _ in range(published):
        ray.get(hub.broadcast.remote(make_policy()))
    # Its heartbeat is the test's to give (beat_now): it registers again when told.
    receiver = start(
        actors, Collector, hub, worker_id="shm", transport="shared_memory", heartbeat_s=3600.0
    )
    ready([receiver])
    kill_and_wait_for_its_restart(hub)
    learner = make_policy()
    new_learner = start(actors, NewLearner)  # no route: it asks the new incarnation for one
    report = ray.get(new_learner.broadcast.remote(name, learner), timeout=120)
    assert (report.version, report.acked) == (published + 1, ())  # nobody registered yet
    ray.get(receiver.__ray_call__.remote(beat_now), timeout=60)  # back: welcomed
    wait_until(
        lambda: ray.get(receiver.version.remote()) == published + 1,
        timeout_s=60,
        what=f"version {published + 1}",
    )
    assert_same(ray.get(receiver.state.remote()), state_of(learner))


@ray.remote(num_cpus=0)
class NewLearner:
    """A learner process of its own, an actor's (killed after the test: a task's
    worker would be reused, with the transports the hub's config registered in it)."""

    def broadcast(self, hub_name: str, model: torch.nn.Module):
        """Its first broadcast to hub ``hub_name``."""
        import raysync

        return ray.get(raysync.get_hub(hub_name).broadcast.remote(model))


@pytest.mark.parametrize("learner_kind", ["new", "same"])
def test_a_restarted_hubs_first_versions_carry_what_its_former_receivers_read(
    actors, learner_kind
):
    """A learner broadcast right after the hub restarted, before a receiver on another
    transport than the hub's (here ``shared_memory``) registered again. One with no
    route yet (``new``: a learner process of its own, or one whose last broadcast died
    with the hub) was told by the new incarnation, which knew none of its receivers,
    to hand the version over to the hub's transport alone: the receiver, back, was
    offered nothing it could read (had it been the learner's last broadcast, it never
    got the latest version). One that kept its route (``same``) handed it to
    ``shared_memory``, whose segment owner had died with the former incarnation and was
    not started again: it waited 30 s for one and failed. The restarted hub opens the
    transports in use before it, and has learners hand versions to them a while."""
    hub = start_hub(
        actors,
        DEFAULT_TRANSPORT,
        {"name": f"restarted-hub-{learner_kind}", "max_restarts": 1, "max_task_retries": 0},
    )
    # Its heartbeat is the test's to give (beat_now): it registers again when told.
    receiver = start(
        actors, Collector, hub, worker_id="shm", transport="shared_memory", heartbeat_s=3600.0
    )
    ready([receiver])
    ray.get(hub.broadcast.remote(make_policy()))
    kill_and_wait_for_its_restart(hub)
    learner = make_policy()
    if learner_kind == "new":  # no route: it asks the new incarnation for one
        new_learner = start(actors, NewLearner)
        sent = new_learner.broadcast.remote(f"restarted-hub-{learner_kind}", learner)
        report = ray.get(sent, timeout=120)
        assert (report.version, report.acked) == (2, ())  # nobody registered yet
        ray.get(receiver.__ray_call__.remote(beat_now), timeout=60)  # back: welcomed
    else:  # its route names the receiver: it delivers the version to it itself
        report = ray.get(hub.broadcast.remote(learner), timeout=120)
        assert (report.version, report.acked) == (2, ("shm",))
    wait_until(lambda: ray.get(receiver.version.remote()) == 2, timeout_s=60, what="version 2")
    assert_same(ray.get(receiver.state.remote()), state_of(learner))

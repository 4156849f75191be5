"""raysync.attach: receivers in actors and processes whose classes know nothing of raysync.

A plain ``@ray.remote`` class attached through Ray's ``__ray_call__``; a threaded actor
whose loop never returns, holding its model per step; the driver in pull mode; leaving
the hub. The mixin is attach underneath, so versions, acks, restarts and safe points are
also what every other receiver test checks.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import ray
import torch

import raysync
from raysync import ModelPathError
from raysync.transports import DEFAULT_TRANSPORT
from tests.helpers import (
    Gate,
    assert_same,
    cut_off_heartbeats,
    hold_until_opened,
    ready,
    start,
    start_hub,
    wait_dead,
    wait_until,
)
from tests.receivers import (
    AsyncHost,
    AsyncPlain,
    Collector,
    Holder,
    LoopingWorker,
    PlainWorker,
    Rebuilder,
    attach_actor_net,
    attach_telling_arrivals,
    connect_again_failing_transport,
    connect_policy_again,
    filled,
    make_policy,
    make_probe_model,
    refuse_versions,
    state_of,
)


def test_a_plain_actor_attached_through_ray_call_acts_on_each_version(actors):
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    worker = start(actors, PlainWorker)
    name = ray.get(worker.__ray_call__.remote(attach_actor_net, hub, worker_id="plain-1"))
    assert name == "plain-1"
    obs = torch.randn(5, 8)
    for _ in range(3):
        learner = make_policy()
        report = ray.get(hub.broadcast.remote(learner, model="policy"))
        assert report.acked == ("plain-1",) and report.failed == {}
        # The host's own method acts with the version just acknowledged (its weights
        # bit for bit; the matmul's summation order may differ between processes).
        with torch.no_grad():
            torch.testing.assert_close(ray.get(worker.act.remote(obs)), learner(obs))
        held = ray.get(worker.__ray_call__.remote(lambda w: state_of(w.nets.actor)))
        assert_same(held, state_of(learner))
    version = ray.get(worker.__ray_call__.remote(lambda w: w.receiver.version()))
    assert version == report.version
    (status,) = ray.get(hub.status.remote()).receivers
    assert status.worker == "plain-1" and "PlainWorker" in status.actor, status
    assert status.versions == {"policy": report.version}


def test_a_receiver_closed_without_leaving_is_failed_once_then_dropped(actors):
    """Its hub was unreachable when it closed: the next broadcast reaches the process,
    finds no receiver under its key, names it, and the hub forgets it."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    worker = start(actors, PlainWorker)
    ray.get(worker.__ray_call__.remote(attach_actor_net, hub, worker_id="closed-1"))
    ray.get(worker.__ray_call__.remote(lambda w: w.receiver.core.close()))
    report = ray.get(hub.broadcast.remote(make_policy(), model="policy", raise_on_failure=False))
    assert report.acked == () and "no raysync receiver is attached" in report.failed["closed-1"]
    assert ray.get(hub.status.remote()).receivers == ()


def test_a_restarted_actor_that_does_not_attach_again_is_failed_once_then_dropped(actors):
    """Ray restarted the host actor and its new process never attached again (the old
    one attached through ``__ray_call__``): each broadcast reached the new process,
    failed it ("died before applying") and kept the registration of the old, for good."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    worker = start(actors, PlainWorker.options(max_restarts=1))
    ray.get(worker.__ray_call__.remote(attach_actor_net, hub, worker_id="restarts"))
    pid = ray.get(worker.__ray_call__.remote(lambda w: os.getpid()))
    ray.kill(worker, no_restart=False)
    wait_until(
        lambda: _pid_or_none(worker) not in (None, pid), what="Ray restarting the worker"
    )
    report = ray.get(hub.broadcast.remote(make_policy(), model="policy", raise_on_failure=False))
    assert report.acked == () and "Ray restarted it" in report.failed["restarts"], report.failed
    assert ray.get(hub.status.remote()).receivers == ()
    report = ray.get(hub.broadcast.remote(make_policy(), model="policy"))
    assert (report.acked, report.failed) == ((), {})


def test_a_restarted_pull_receiver_that_does_not_attach_again_is_dropped(actors):
    """A pull receiver is called by nobody: once its heartbeats stopped the hub asked
    Ray whether its actor was alive, and a new process Ray restarted it into answered
    for it: the old registration was kept for good."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    worker = start(actors, PlainWorker.options(max_restarts=1))
    ray.get(
        worker.__ray_call__.remote(
            attach_actor_net, hub, worker_id="pulls", mode="pull", heartbeat_s=0.2
        )
    )
    pid = ray.get(worker.__ray_call__.remote(lambda w: os.getpid()))
    ray.kill(worker, no_restart=False)
    wait_until(
        lambda: _pid_or_none(worker) not in (None, pid), what="Ray restarting the worker"
    )
    wait_until(
        lambda: ray.get(hub.status.remote()).receivers == (), what="the hub dropping it"
    )


def _pid_or_none(actor) -> int | None:
    """The actor's process id, or None while it does not answer."""
    try:
        return ray.get(actor.__ray_call__.remote(lambda a: os.getpid()), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def test_an_attach_whose_first_version_fails_leaves_nothing_registered(actors):
    """attach raised (the version the hub welcomed it with failed its hook): the caller
    holds no receiver to close, so attach must not leave one registered behind it."""
    hub = start_hub(actors, DEFAULT_TRANSPORT, models=("policy",))
    ray.get(hub.broadcast.remote(make_policy(), model="policy"))
    worker = start(actors, PlainWorker)
    with pytest.raises(ray.exceptions.RayTaskError, match="refuses version 1"):
        ray.get(
            worker.__ray_call__.remote(
                attach_actor_net, hub, worker_id="refuses", on_applied=refuse_versions
            )
        )
    assert ray.get(hub.status.remote()).receivers == ()
    held = ray.get(worker.__ray_call__.remote(lambda w: state_of(w.nets.actor)))
    report = ray.get(hub.broadcast.remote(make_policy(), model="policy"))
    assert (report.acked, report.failed) == ((), {})
    assert_same(ray.get(worker.__ray_call__.remote(lambda w: state_of(w.nets.actor))), held)


def test_a_threaded_loop_that_never_returns_takes_each_version_between_steps(actors):
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    worker = start(actors, LoopingWorker)
    template = make_probe_model(64, 4)
    run = worker.run.remote(hub)
    assert ray.get(worker.wait_attached.remote(60))
    for value in range(1, 7):
        report = ray.get(hub.broadcast.remote(filled(template, float(value))))
        assert len(report.acked) == 1 and report.failed == {}
    ray.get(worker.stop.remote())
    result = ray.get(run)
    assert result["torn"] == 0, result
    # Versions landed while the loop ran, in order, the last one included.
    assert result["seen"] == sorted(result["seen"]) and result["seen"][-1] == 6.0, result
    assert len(result["seen"]) > 1, result
    # The loop closed its receiver: the hub no longer counts it.
    assert ray.get(hub.status.remote()).receivers == ()


def test_an_async_actor_attached_from_a_coroutine_applies_between_its_reads(actors):
    """Ray runs ``__ray_call__`` of an async actor off its event loop: the delivery is
    handed to the loop, where a version waits for the readers parked at an await."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    host = start(actors, AsyncHost)
    ray.get(host.attach.remote(hub))
    template = make_probe_model(64, 4)
    ray.get(hub.broadcast.remote(filled(template, 1.0)))
    entered = start(actors, Gate)
    probe = host.probe.remote(2.0, entered)
    ray.get(entered.wait.remote())  # it reads before any version is sent
    tickets = ray.get(
        [hub.broadcast.remote(filled(template, float(v)), wait=False) for v in range(2, 9)]
    )
    result = ray.get(probe)
    reports = ray.get([hub.wait_for.remote(t) for t in tickets])
    assert all(len(r.acked) == 1 and r.failed == {} for r in reports), reports
    assert result["torn"] == 0 and result["reads"] > 10, result
    assert result["seen"] == sorted(result["seen"]) and len(result["seen"]) > 1, result


def test_an_async_actor_attached_through_ray_call_is_written_on_its_event_loop(actors):
    """An async actor you did not write is attached through ``__ray_call__``, which Ray
    runs off the actor's event loop: the receiver found no loop, and a version was
    written there while a coroutine of the actor was reading the model, no await in
    between (a torn read). The write goes to the actor's loop, between its steps."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    host = start(actors, AsyncPlain)
    worker = ray.get(host.__ray_call__.remote(attach_telling_arrivals, hub))
    template = make_probe_model(64, 4)
    ray.get(hub.broadcast.remote(filled(template, 1.0)))
    ray.get(host.__ray_call__.remote(lambda h: (h.arrived.clear(), h.reading.clear())))
    entered = start(actors, Gate)
    reading = host.read_across_a_delivery.remote(entered, 3.0)
    ray.get(entered.wait.remote())
    ticket = ray.get(hub.broadcast.remote(filled(template, 2.0), wait=False))
    first, last, arrived = ray.get(reading)
    assert arrived, "the delivery never reached the receiver while the coroutine ran"
    assert first == last == [1.0] * len(first), (first, last)
    report = ray.get(hub.wait_for.remote(ticket))
    assert report.acked == (worker,) and report.failed == {}, report
    assert ray.get(host.values.remote()) == [2.0] * len(first)


def test_the_driver_attaches_in_pull_mode(actors):
    hub = start_hub(actors, DEFAULT_TRANSPORT, models=["policy"])
    first = make_policy()
    ray.get(hub.broadcast.remote(first, model="policy"))
    mine = make_policy()
    with pytest.raises(ValueError, match="mode='pull'"):
        raysync.attach(hub, {"policy": mine})
    receiver = raysync.attach(hub, {"policy": mine}, mode="pull", heartbeat_s=None)
    try:
        # Attaching applies the latest version at once.
        assert receiver.versions() == {"policy": 1}
        assert_same(state_of(mine), state_of(first))
        second = make_policy()
        report = ray.get(hub.broadcast.remote(second, model="policy"))
        assert report.acked == ()  # pull receivers are not waited for
        assert receiver.version("policy") == 1
        assert receiver.pull() == {"policy": 2}
        assert_same(state_of(mine), state_of(second))
    finally:
        receiver.close()
    assert receiver.closed
    assert ray.get(hub.status.remote()).receivers == ()


def test_a_receiver_attached_in_a_with_block_leaves_at_its_end_and_pulls_no_more(actors):
    """A task's process is reused by the next task: a receiver left attached kept its
    heartbeat, its registration and its worker id (the next task's attach was refused).
    A closed receiver's pull fetched the version and applied nothing, silently."""
    hub = start_hub(actors, DEFAULT_TRANSPORT, models=["policy"])
    ray.get(hub.broadcast.remote(make_policy(), model="policy"))
    mine = make_policy()
    with raysync.attach(hub, {"policy": mine}, mode="pull", heartbeat_s=None) as receiver:
        assert [r.worker for r in ray.get(hub.status.remote()).receivers] == [receiver.worker]
    assert receiver.closed and ray.get(hub.status.remote()).receivers == ()
    ray.get(hub.broadcast.remote(make_policy(), model="policy"))
    with pytest.raises(raysync.RaySyncError, match="is closed: it pulls nothing"):
        receiver.pull()
    assert receiver.version("policy") == 1


def test_a_pull_receiver_registered_again_takes_versions_only_when_it_pulls(actors):
    """After a hub restart the hub watch registers the driver's pull receiver again;
    the hub's welcome offered a version published meanwhile, which the watch applied
    on its own thread, behind the back of a driver reading its model. The driver's next
    pull takes it."""
    hub = start_hub(actors, DEFAULT_TRANSPORT, actor_options={"max_restarts": 1}, models=["policy"])
    first = make_policy()
    ray.get(hub.broadcast.remote(first, model="policy", timeout_s=30))
    mine = make_policy()
    receiver = raysync.attach(hub, {"policy": mine}, mode="pull", heartbeat_s=0.1)
    core = receiver.core
    asks, beat_may_ask = [], threading.Event()
    knows = core.hub_knows_me

    def held_then_asked(timeout_s: float) -> bool:
        beat_may_ask.wait()
        asks.append(1)
        return knows(timeout_s)

    core.hub_knows_me = held_then_asked  # the watch's beats wait for the test
    try:
        boot = ray.get(hub.status.remote()).boot_id
        ray.kill(hub.actor, no_restart=False)
        wait_until(lambda: _booted_since(hub, boot), what="the hub restarted")
        second = make_policy()
        ray.get(hub.broadcast.remote(second, model="policy", timeout_s=30))  # none of it
        beat_may_ask.set()
        # The beat that registered again (and, before, applied the version) has ended
        # once the next one asks.
        wait_until(lambda: len(asks) >= 2 and receiver.connection().connected, what="back")
        assert receiver.versions() == {"policy": 1}
        assert_same(state_of(mine), state_of(first))
        assert receiver.pull() == {"policy": 2}
        assert_same(state_of(mine), state_of(second))
    finally:
        beat_may_ask.set()
        receiver.close()


def test_a_pull_receiver_without_a_hub_watch_pulls_from_a_restarted_hub(actors):
    """A restarted hub knows no receiver until it registers again, and a pull receiver
    with no hub watch (``heartbeat_s=None``) has nothing that does: each pull was
    refused for good ("not registered"). A pull registers it again and reads."""
    hub = start_hub(actors, DEFAULT_TRANSPORT, actor_options={"max_restarts": 1}, models=["policy"])
    ray.get(hub.broadcast.remote(make_policy(), model="policy", timeout_s=30))
    mine = make_policy()
    receiver = raysync.attach(hub, {"policy": mine}, mode="pull", heartbeat_s=None)
    try:
        boot = ray.get(hub.status.remote()).boot_id
        ray.kill(hub.actor, no_restart=False)
        wait_until(lambda: _booted_since(hub, boot), what="the hub restarted")
        second = make_policy()
        ray.get(hub.broadcast.remote(second, model="policy", timeout_s=30))
        assert receiver.pull() == {"policy": 2}
        assert_same(state_of(mine), state_of(second))
        assert [r.worker for r in ray.get(hub.status.remote()).receivers] == [receiver.worker]
    finally:
        receiver.close()


def test_a_driver_pull_receiver_that_stops_beating_is_forgotten(actors):
    """No actor to ask Ray about: once its heartbeats lapse the hub drops it (it asked
    a handle it does not have, failed on every beat and kept it for good)."""
    hub = start_hub(actors, DEFAULT_TRANSPORT, models=["policy"])
    mine = make_policy()
    receiver = raysync.attach(hub, {"policy": mine}, mode="pull", heartbeat_s=0.2)
    try:
        assert [r.worker for r in ray.get(hub.status.remote()).receivers] == [receiver.worker]
        cut_off_heartbeats(SimpleNamespace(_raysync_receiver=receiver))
        wait_until(lambda: ray.get(hub.status.remote()).receivers == (), what="the hub forgot it")
    finally:
        receiver.close()


def _booted_since(hub, boot: str) -> bool:
    """Whether a new incarnation of ``hub`` answers (the old one may still answer
    just after ``ray.kill``)."""
    try:
        return ray.get(hub.status.remote(), timeout=5).boot_id != boot
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


def test_paths_without_an_owner_are_refused(ray_cluster):
    with pytest.raises(ValueError, match=r"'nets.actor'.*owner="):
        raysync.attach("no-such-hub", {"policy": "nets.actor"}, mode="pull")


@pytest.mark.parametrize(
    "seconds, message",
    [
        ({"heartbeat_s": 0}, "heartbeat_s must be a positive number of seconds, got 0"),
        ({"heartbeat_s": -1.0}, "heartbeat_s must be a positive number of seconds, got -1.0"),
        ({"timeout_s": float("nan")}, "timeout_s must be a positive number of seconds, got nan"),
    ],
)
def test_a_heartbeat_or_timeout_of_no_positive_seconds_is_refused(ray_cluster, seconds, message):
    """A zero heartbeat had the receiver's watch, and the hub's watch of a pull
    receiver, spin without a pause."""
    with pytest.raises(ValueError, match=message):
        raysync.attach("no-such-hub", make_policy(), mode="pull", **seconds)


def test_a_new_model_object_registered_again_is_brought_to_the_latest_version(actors):
    """connect_hub again, from one of the actor's methods, with a fresh policy at the
    same path: the version the old object held is not carried over to it, so the hub's
    welcome applies the latest, inside that method (which the gate counts as a reader
    of the models: the new registration keeps the gate that counted it)."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    worker = start(actors, Rebuilder, hub)
    ready([worker])
    learner = make_policy()
    ray.get(hub.broadcast.remote(learner))
    assert_same(ray.get(worker.state.remote()), state_of(learner))
    ray.get(worker.rebuild.remote(), timeout=60)
    assert_same(ray.get(worker.state.remote()), state_of(learner))
    assert ray.get(worker.weights_version.remote()) == 1


def test_registering_again_with_a_wrong_path_leaves_the_receiver_as_it_was(actors):
    """``connect_hub`` again naming a path the actor lacks raises, naming it; the
    registration before it goes on receiving (it had been retired before the path was
    looked up: every later version was refused as from a receiver that left)."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    collector = start(actors, Collector, hub, worker_id="c")
    ready([collector])
    ray.get(hub.broadcast.remote(make_policy()))
    with pytest.raises(ModelPathError, match="polcy"):
        ray.get(collector.__ray_call__.remote(connect_policy_again, hub, "polcy"))
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner), timeout=60)
    assert (report.version, report.acked) == (2, ("c",))
    assert_same(ray.get(collector.state.remote()), state_of(learner))


def test_registering_again_whose_transport_fails_to_open_leaves_the_receiver_receiving(actors):
    """``connect_hub`` again whose transport receiver cannot open once the hub accepted
    it raises; the registration before it goes on (the hub had the new one, the old
    core was closed and the new one never made: every version waited, then failed as
    for a receiver not attached). The hub forgets the new one, and the old core's
    watch registers it again."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    collector = start(actors, Collector, hub, worker_id="c", heartbeat_s=0.5)
    ready([collector])
    ray.get(hub.broadcast.remote(make_policy()))
    with pytest.raises(RuntimeError, match="could not be opened"):
        ray.get(collector.__ray_call__.remote(connect_again_failing_transport, hub))
    wait_until(
        lambda: [r.worker for r in ray.get(hub.status.remote()).receivers] == ["c"],
        what="the receiver registered again",
    )
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner), timeout=60)
    assert report.acked == ("c",)
    assert_same(ray.get(collector.state.remote()), state_of(learner))


def test_a_worker_id_another_live_actor_holds_is_refused_naming_both(actors):
    """Two actors given one worker id registered over each other at every heartbeat: a
    broadcast reached, and its report named, whichever held the id then, the other one
    behind with nothing said. Once the first is dead, the id may be taken over."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    first = start(actors, Collector, hub, worker_id="dup")
    ready([first])
    second = start(actors, Collector, hub, worker_id="dup")
    with pytest.raises(ray.exceptions.RayActorError, match="worker id 'dup' is registered by"):
        ready([second])
    learner = make_policy()
    assert ray.get(hub.broadcast.remote(learner)).acked == ("dup",)
    assert_same(ray.get(first.state.remote()), state_of(learner))
    ray.kill(first)
    wait_dead(first)
    third = start(actors, Collector, hub, worker_id="dup")
    ready([third])
    assert_same(ray.get(third.state.remote()), state_of(learner))  # welcomed with it
    assert ray.get(hub.broadcast.remote(make_policy())).acked == ("dup",)


def test_a_worker_id_whose_holder_does_not_answer_passes_to_its_new_actor(actors):
    """A holder that does not answer within 2 s (busy in a method here; on a node that
    died and Ray does not know it yet, in the case this is for) gives the id up: a
    replacement must get in."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    busy = start(actors, Holder, hub, state_of(make_policy()), "dup", "policy")
    ready([busy])
    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, busy, gate)
    replacement = start(actors, Collector, hub, worker_id="dup")
    ready([replacement])
    learner = make_policy()
    assert ray.get(hub.broadcast.remote(learner)).acked == ("dup",)
    assert_same(ray.get(replacement.state.remote()), state_of(learner))
    ray.get(gate.open.remote())
    ray.get(blocked)


def test_attaching_twice_as_one_worker_is_refused_naming_it(actors):
    """Two receivers of one process attached to one hub under the same worker id (the
    default: the actor's id) replaced each other at the hub at every heartbeat, and a
    broadcast of the one replaced reached nobody."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    worker = start(actors, PlainWorker)
    first = ray.get(worker.__ray_call__.remote(attach_actor_net, hub))
    with pytest.raises(ValueError, match=f"as worker '{first}' already"):
        ray.get(worker.__ray_call__.remote(attach_actor_net, hub))
    learner = make_policy()
    assert ray.get(hub.broadcast.remote(learner, model="policy")).acked == (first,)
    held = ray.get(worker.__ray_call__.remote(lambda w: state_of(w.nets.actor)))
    assert_same(held, state_of(learner))


def test_connecting_to_another_hub_starts_from_its_versions(actors):
    """A receiver moved to a new hub (its first died for good) reported the old hub's
    version, which the new one took for its own: the new hub's latest version, lower,
    was not offered, and the receiver kept the old weights."""
    old = start_hub(actors, DEFAULT_TRANSPORT)
    new = start_hub(actors, DEFAULT_TRANSPORT, models=["policy"])
    collector = start(actors, Collector, old, worker_id="c")
    ready([collector])
    for _ in range(3):
        ray.get(old.broadcast.remote(make_policy()))
    learner = make_policy()
    assert ray.get(new.broadcast.remote(learner, model="policy")).version == 1  # before it joins
    ray.get(collector.__ray_call__.remote(connect_policy_again, new))
    assert ray.get(collector.version.remote()) == 1
    assert_same(ray.get(collector.state.remote()), state_of(learner))
    assert ray.get(new.status.remote()).versions == {"policy": 1}
    # The old hub, if it lives, is told: it no longer counts the receiver (each of its
    # broadcasts failed it as one that left).
    wait_until(lambda: not ray.get(old.status.remote()).receivers, what="the old hub forgot it")
    assert ray.get(old.broadcast.remote(make_policy())).acked == ()

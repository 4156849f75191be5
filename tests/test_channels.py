"""Learners' channels (``WeightHub.remote(channels=True)``, raysync/learner_channel.py):
small versions written once into a Ray compiled graph to the mixin receivers on the
learner's node, with every guarantee of the direct path: versions in the hub's order,
acks per worker, bitwise weights, a model changed only at a safe point, a death that
fails only its receiver (the channel is rebuilt without it), and a receiver another
learner's channel holds reached the plain way."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import ray
import torch

import raysync.learner_channel
from raysync import BroadcastError
from tests.helpers import (
    Gate,
    actor_pid,
    ask_refused_channels_again,
    assert_same,
    ready,
    start,
    start_hub,
    wait_process_exit,
    wait_until,
)
from tests.receivers import Collector, OtherLearner, Reader, make_policy, state_of


@pytest.fixture
def channel_hub(actors):
    """A hub with channels; the learner's channels torn down after the test."""
    hub = start_hub(actors, "object_store", channels=True)
    yield hub
    hub.release()


def _hold(receivers, learner, version: int) -> None:
    for r in receivers:
        assert ray.get(r.version.remote()) == version
        assert_same(ray.get(r.state.remote()), state_of(learner))


def test_small_versions_travel_by_channel_once_it_is_built(actors, channel_hub):
    hub = channel_hub
    collectors = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(3)]
    ready(collectors)
    report = ray.get(hub.broadcast.remote(make_policy()))  # asks for the channel
    assert (report.version, report.direct, report.channel) == (1, ("c0", "c1", "c2"), ())
    assert sorted(hub.wait_channel("policy")) == ["c0", "c1", "c2"]
    for expected in range(2, 6):
        learner = make_policy()
        report = ray.get(hub.broadcast.remote(learner))
        assert (report.version, report.acked, report.failed) == (expected, ("c0", "c1", "c2"), {})
        assert report.channel == ("c0", "c1", "c2")
        _hold(collectors, learner, expected)
    assert all(
        ray.get(c.applied_versions.remote()) == [("policy", v) for v in range(1, 6)]
        for c in collectors
    )
    # A receiver that joins is delivered by the hub; the channel is built again with it.
    late = start(actors, Collector, hub, worker_id="late")
    ready([late])
    ray.get(hub.broadcast.remote(make_policy()))  # its route was asked before the join
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner))
    assert report.acked == ("c0", "c1", "c2", "late") and report.channel == ()
    _hold([*collectors, late], learner, 7)
    assert sorted(hub.wait_channel("policy")) == ["c0", "c1", "c2", "late"]
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner))
    assert (report.version, report.channel) == (8, ("c0", "c1", "c2", "late"))
    _hold([*collectors, late], learner, 8)


def test_a_version_cast_on_the_wire_arrives_as_the_cast(actors, channel_hub):
    hub = channel_hub
    collector = start(actors, Collector, hub, worker_id="c")
    ready([collector])
    ray.get(hub.broadcast.remote(make_policy()))
    assert hub.wait_channel("policy") == ("c",)
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner, wire_dtype=torch.bfloat16))
    assert report.channel == ("c",)
    assert report.bytes == sum(v.numel() * 2 for v in learner.state_dict().values())
    expected = {k: v.to(torch.bfloat16).to(v.dtype) for k, v in state_of(learner).items()}
    assert_same(ray.get(collector.state.remote()), expected)


def test_a_receiver_busy_in_a_method_gets_the_version_after_it(actors, channel_hub):
    hub = channel_hub
    reader = start(actors, Reader, hub, worker_id="r")
    ready([reader])
    first = make_policy()
    ray.get(hub.broadcast.remote(first))
    assert hub.wait_channel("policy") == ("r",)
    entered, leave = Gate.remote(), Gate.remote()
    actors.extend([entered, leave])
    read = reader.read_across.remote(entered, leave)
    ray.get(entered.wait.remote())
    second = make_policy()
    report_ref = hub.broadcast.remote(second)  # waits for the method to leave
    ray.get(leave.open.remote())
    at_entry, at_exit = ray.get(read)
    assert_same(at_entry, state_of(first))
    assert_same(at_exit, state_of(first))  # never changed under the running method
    report = ray.get(report_ref)
    assert (report.version, report.acked, report.channel) == (2, ("r",), ("r",))
    _hold([reader], second, 2)


def test_a_receiver_busy_past_the_timeout_fails_alone(actors, channel_hub):
    """Ray reads a graph's replies all at once, so a receiver busy past the broadcast's
    timeout holds back the others' replies too. The hub then calls each receiver whose
    reply it lacks, in the time left: the idle one, which applied the version, acks."""
    hub = channel_hub
    busy = start(actors, Reader, hub, worker_id="busy")
    idle = start(actors, Collector, hub, worker_id="idle")
    ready([busy, idle])
    ray.get(hub.broadcast.remote(make_policy()))
    assert sorted(hub.wait_channel("policy")) == ["busy", "idle"]
    entered, leave = Gate.remote(), Gate.remote()
    actors.extend([entered, leave])
    read = busy.read_across.remote(entered, leave)
    ray.get(entered.wait.remote())
    learner = make_policy()
    sent = hub.broadcast.remote(learner, timeout_s=4.0, raise_on_failure=False)
    report = ray.get(sent, timeout=60)
    assert report.acked == ("idle",) and set(report.failed) == {"busy"}, report.failed
    _hold([idle], learner, 2)
    ray.get(leave.open.remote())
    ray.get(read)


def test_a_receiver_killed_fails_alone_and_the_channel_is_built_without_it(actors, channel_hub):
    hub = channel_hub
    collectors = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(3)]
    ready(collectors)
    ray.get(hub.broadcast.remote(make_policy()))
    assert sorted(hub.wait_channel("policy")) == ["c0", "c1", "c2"]
    pid = actor_pid(collectors[2])
    ray.kill(collectors[2])
    wait_process_exit(pid)  # else it may still read the channel (no call fails there)
    learner = make_policy()
    with pytest.raises(BroadcastError) as caught:
        ray.get(hub.broadcast.remote(learner))
    report = caught.value.report
    assert report.acked == ("c0", "c1") and set(report.failed) == {"c2"}
    assert "died" in report.failed["c2"]
    _hold(collectors[:2], learner, 2)
    # The hub dropped it: a later route leaves it out, and the channel is built again.
    for _ in range(3):
        ray.get(hub.broadcast.remote(make_policy()))
        if sorted(hub.wait_channel("policy")) == ["c0", "c1"]:
            break
    assert sorted(hub.wait_channel("policy")) == ["c0", "c1"]
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner))
    assert report.channel == ("c0", "c1") and report.failed == {}
    _hold(collectors[:2], learner, report.version)


def test_a_receiver_in_another_learners_channel_is_called_the_plain_way(actors, channel_hub):
    first = channel_hub
    second = start(actors, OtherLearner, first)  # another learner of the same hub
    collectors = [start(actors, Collector, first, worker_id=f"c{i}") for i in range(2)]
    ready(collectors)
    ray.get(first.broadcast.remote(make_policy()))
    assert sorted(first.wait_channel("policy")) == ["c0", "c1"]
    ray.get(second.broadcast.remote(make_policy()))
    assert ray.get(second.wait_channel.remote("policy")) == ()  # the first's holds them
    # A learner whose route is stale (the other overtook its number) goes through the
    # hub, numbered above the number the other's last report routed it (skipped).
    for learner_of, expected, by_channel in (
        (second, 4, ()),
        (first, 6, ()),
        (first, 7, ("c0", "c1")),
        (second, 9, ()),
    ):
        if by_channel:  # the replies to the first's stale write (version 4's) are in
            assert sorted(first.wait_channel("policy")) == list(by_channel)
        learner = make_policy()
        report = ray.get(learner_of.broadcast.remote(learner))
        assert (report.version, report.acked) == (expected, ("c0", "c1"))
        assert report.channel == by_channel
        _hold(collectors, learner, expected)
    # Once the first learner lets its channel go, the second's is built (refused sets
    # are asked again after a while: at once here).
    first.release()
    ray.get(second.__ray_call__.remote(ask_refused_channels_again))
    for _ in range(3):  # the first's releases and the second's claims cross
        ray.get(second.broadcast.remote(make_policy()))
        if sorted(ray.get(second.wait_channel.remote("policy"))) == ["c0", "c1"]:
            break
    assert sorted(ray.get(second.wait_channel.remote("policy"))) == ["c0", "c1"]
    learner = make_policy()
    report = ray.get(second.broadcast.remote(learner))
    assert report.channel == ("c0", "c1") and report.acked == ("c0", "c1")
    _hold(collectors, learner, report.version)


#: A learner in a driver of its own: it broadcasts through its channel to receiver "c"
#: of the named hub, then exits without ``release()`` (Ray's exit hook runs).
_EXITING_LEARNER = """
import sys
import ray
from raysync import get_hub
from tests.receivers import make_policy

address, namespace, name = sys.argv[1:]
ray.init(address=address, namespace=namespace)
hub = get_hub(name, namespace=namespace)
ray.get(hub.broadcast.remote(make_policy()))
assert hub.wait_channel("policy") == ("c",)
assert ray.get(hub.broadcast.remote(make_policy())).channel == ("c",)
print("broadcast by channel", flush=True)
"""


def test_a_learner_that_exits_without_release_kills_no_receiver(actors):
    """Ray's ``ray.shutdown()``, run at a driver's exit, tears down its compiled graphs
    killing every actor in them: a learner's exit killed the receivers of its channel,
    which it does not own (here: the test's). They live on, and another learner builds
    its channel to them."""
    context = ray.get_runtime_context()
    name = f"hub-{uuid.uuid4().hex[:8]}"
    options = {"name": name, "namespace": context.namespace}
    hub = start_hub(actors, "object_store", actor_options=options, channels=True)
    collector = start(actors, Collector, hub, worker_id="c")
    ready([collector])
    learner = subprocess.run(
        [sys.executable, "-c", _EXITING_LEARNER, context.gcs_address, context.namespace, name],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "broadcast by channel" in learner.stdout, learner.stderr[-3000:]
    ray.get(collector.__ray_ready__.remote(), timeout=30)
    ray.get(hub.broadcast.remote(make_policy()))
    assert hub.wait_channel("policy") == ("c",)  # the exiting learner's claim was freed
    weights = make_policy()
    report = ray.get(hub.broadcast.remote(weights))
    assert (report.acked, report.channel) == (("c",), ("c",))
    _hold([collector], weights, report.version)
    hub.release()


def test_a_killed_learners_receivers_serve_the_next_learners_channel(
    actors, channel_hub, monkeypatch
):
    """A learner killed without ``release()`` (SIGKILL, out of memory) kept its claim on
    its receivers' compiled-graph thread, and its graph's loop waited there for ever:
    every later learner reached them the plain way. The next learner's claim now finds
    the holder dead, cancels its loop and builds its own channel."""
    hub = channel_hub
    killed = start(actors, OtherLearner, hub)
    collectors = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(2)]
    ready(collectors)
    ray.get(killed.broadcast.remote(make_policy()))
    assert sorted(ray.get(killed.wait_channel.remote("policy"))) == ["c0", "c1"]
    assert ray.get(killed.broadcast.remote(make_policy())).channel == ("c0", "c1")
    ray.kill(killed)
    # Refused sets are asked again at once (Ray finds the owner of the killed
    # learner's graph dead within seconds: claims before that are refused).
    monkeypatch.setattr(raysync.learner_channel, "REFUSED_FOR_S", 0.0)

    def channel_built() -> bool:
        ray.get(hub.broadcast.remote(make_policy()))
        return sorted(hub.wait_channel("policy")) == ["c0", "c1"]

    wait_until(channel_built, timeout_s=60, what="the next learner's channel")
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner))
    assert (report.acked, report.channel, report.failed) == (("c0", "c1"), ("c0", "c1"), {})
    _hold(collectors, learner, report.version)


def test_a_learner_killed_before_passing_on_its_channels_replies_fails_nobody(actors, channel_hub):
    """A learner whose receivers' replies were not in when its broadcast went on passes
    them to the hub later (``channel_replies``). Killed before that, it left the hub
    waiting for them until the broadcast's timeout, and a receiver that applied the
    version failed it. The hub now finds the learner dead (it owns the channel's loop
    on the receiver) and calls the receiver itself, which acks the version it holds."""
    hub = channel_hub
    killed = start(actors, OtherLearner, hub)
    reader = start(actors, Reader, hub, worker_id="r")
    ready([reader])
    ray.get(killed.broadcast.remote(make_policy()))
    assert ray.get(killed.wait_channel.remote("policy")) == ("r",)
    entered, leave = Gate.remote(), Gate.remote()
    actors.extend([entered, leave])
    read = reader.read_across.remote(entered, leave)
    ray.get(entered.wait.remote())  # the version's reply waits for the method to leave
    learner = make_policy()
    ticket = ray.get(killed.broadcast.remote(learner, wait=False, timeout_s=20.0))
    pid = actor_pid(killed)
    ray.kill(killed)
    wait_process_exit(pid)
    ray.get(leave.open.remote())
    ray.get(read)
    report = ray.get(hub.wait_for.remote(ticket, raise_on_failure=False))
    assert (report.version, report.acked, report.failed) == (2, ("r",), {})
    _hold([reader], learner, 2)

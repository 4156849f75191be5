"""Bucketed versions (``bucket_mb``) with tiny buckets, on the object store, on RPC (one
call per bucket) and on torch.distributed (one collective per bucket): every version
lands bitwise and whole at one safe point, the object store never holds more than two
buckets of it, a receiver that holds the others up (or dies) fails alone, a version
whose learner dies after some buckets were copied leaves every model untouched, late
joiners read the latest version from a holder."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
import torch

from raysync import AS_IS, DistributedOptions, RpcOptions, WeightHub, WeightReceiver, hub_handle
from raysync.testing import (
    MODEL,
    ConformanceReceiver,
    PartLearner,
    assert_bitwise,
    special_weights,
    split_in_parts,
    through_bfloat16,
    uniform_weights,
)
from raysync.transports import register_transport
from raysync.transports.base import TransportError
from raysync.transports.distributed import process_group_name, rank0_reader
from raysync.transports.nixl import NixlSender
from raysync.transports.object_store.bucket_stream import (
    BROKER_NAMESPACE,
    BUCKETS_IN_FLIGHT,
    BucketStream,
    StreamId,
    broker_name,
)
from raysync.transports.object_store.buckets import buckets_of
from raysync.transports.object_store.learner import ObjectStoreSender
from raysync.transports.rdt import RdtTransport
from raysync.transports.rdt.learner import RdtSender
from raysync.transports.rpc import agent_name
from tests.helpers import (
    Gate,
    actor_pid,
    hold_until_opened,
    ready,
    start,
    start_hub,
    wait_dead,
    wait_process_exit,
    wait_until,
)
from tests.nixl_actors import (
    CrossingLearner,
    PairHolder,
    RdtCrossingLearner,
    RdtPairHolder,
)
from tests.third_party_transport import PackedObjectTransport, PutReaderTransport

#: 1 KiB buckets: the ~9 KB test model moves in about ten.
TINY_MB = 1 / 1024
#: The transports that move buckets: each test marked ``BUCKETED`` runs on a hub of each,
#: and the ``crew`` fixture starts one of each.
BUCKETED_TRANSPORTS = ["object_store", "shared_memory", "rpc", "distributed", "nixl"]
BUCKETED = pytest.mark.parametrize("transport", BUCKETED_TRANSPORTS)
#: The transports whose learner streams a bucketed version out of registered slots.
RINGS = pytest.mark.parametrize(
    "transport",
    [
        "nixl",
        pytest.param(
            "rdt",
            marks=pytest.mark.skipif(
                not RdtTransport.availability().available,
                reason=f"rdt unavailable: {RdtTransport.availability().reason}",
            ),
        ),
    ],
)
#: The receivers of each transport's shared hub (the ``crew`` fixture).
CREW = ("r0", "r1")


@ray.remote(num_cpus=0)
class Receiver(ConformanceReceiver):
    def hold(self, gate, entered=None) -> None:
        """Hold the actor's only method slot until the test opens ``gate``; ``entered``
        (a Gate too) is opened on the way in."""
        if entered is not None:
            ray.get(entered.open.remote())
        ray.get(gate.wait.remote())

    def fail_next_fetch(self) -> None:
        """Make this receiver's next fetch fail before it reads anything (as a lost
        bucket or a failed READ would)."""
        transport = self._raysync_receiver.core.transport
        fetch = transport.fetch

        def failing(payload, spec):
            transport.fetch = fetch
            raise TransportError("could not read the version (injected)")

        transport.fetch = failing


ShardLearner = ray.remote(num_cpus=0)(PartLearner)


@ray.remote(num_cpus=0)
class Learner:
    """A learner process of its own, so the test can kill it mid-version."""

    def __init__(self, hub) -> None:
        self.hub = hub

    def send(self, weights: dict[str, torch.Tensor], **broadcast) -> None:
        self.hub.broadcast.remote(weights, model=MODEL, **broadcast)

    def report(self, weights: dict[str, torch.Tensor], **broadcast):
        """Broadcast and wait for the report (the call returns once every bucket is put,
        which here waits for a busy reader: the test goes on meanwhile)."""
        return ray.get(self.hub.broadcast.remote(weights, model=MODEL, **broadcast))


@ray.remote(num_cpus=0)
class LearnerDyingAtItsFirstBucket:
    """A learner process that hands a bucketed version to the hub and is killed as it
    puts bucket 0, before it offers the broker any bucket."""

    def __init__(self, hub) -> None:
        self.hub = hub

    def send(self, weights: dict[str, torch.Tensor], **broadcast) -> None:
        from raysync.transports.object_store import buckets

        buckets.put_arrays = lambda arrays: os.kill(os.getpid(), signal.SIGKILL)
        self.hub.broadcast.remote(weights, model=MODEL, **broadcast)


def broker_of(hub):
    return ray.get_actor(broker_name(hub.config.hub_id), namespace=BROKER_NAMESPACE)


@pytest.fixture(scope="module", params=BUCKETED_TRANSPORTS)
def crew(request, ray_cluster):
    """A bucketed hub on each bucketed transport and its receivers ``r0`` and ``r1``,
    shared by the tests of that transport that leave them alive (pytest runs them one
    transport after another): each broadcasts to ``CREW`` only, and checks versions
    relative to where the previous test left them."""
    hub = WeightHub.remote(transport=request.param, models=[MODEL], bucket_mb=TINY_MB)
    receivers = [Receiver.remote(hub, worker) for worker in CREW]
    ready(receivers)
    yield hub, receivers
    hub.release()  # this process's side of the transport (a NIXL agent) goes too
    for handle in (hub.actor, *receivers):
        ray.kill(handle)


def to_crew(hub, weights: dict[str, torch.Tensor], **broadcast):
    """Broadcast ``weights`` to the crew's receivers; the report."""
    return ray.get(
        hub.broadcast.remote(weights, model=MODEL, workers=CREW, **broadcast), timeout=60
    )


def test_bucketed_versions_land_bitwise_in_every_receiver(crew):
    hub, receivers = crew
    start_version = ray.get(receivers[0].version.remote())
    for seed in (1.0, 2.0, 3.0):
        weights = special_weights(seed)
        report = to_crew(hub, weights)
        assert report.acked == CREW
        for receiver in receivers:
            assert_bitwise(ray.get(receiver.state.remote()), weights)
    assert [ray.get(r.version.remote()) for r in receivers] == [start_version + 3] * 2
    broker = broker_of(hub)
    assert ray.get(broker.stats.remote()).peak_buckets <= BUCKETS_IN_FLIGHT
    # Every stream ends once its readers said they took it all (a message each sends
    # before it applies: it may reach the broker after the report reached us).
    wait_until(lambda: ray.get(broker.stats.remote()).streams == 0)


def test_a_broadcast_sets_its_own_bucket_size_and_small_versions_go_whole(actors):
    hub = start_hub(actors, "object_store", models=[MODEL])
    receiver = start(actors, Receiver, hub, "r0")
    ready([receiver])
    weights = special_weights(1.0)
    ray.get(hub.broadcast.remote(weights, model=MODEL, bucket_mb=1.0), timeout=60)
    assert_bitwise(ray.get(receiver.state.remote()), weights)
    with pytest.raises(ValueError, match="no broker|not found|Failed to look up"):
        broker_of(hub)  # the version fit in one bucket: it went whole, no broker started
    weights = special_weights(2.0)
    ray.get(hub.broadcast.remote(weights, model=MODEL, bucket_mb=TINY_MB), timeout=60)
    assert_bitwise(ray.get(receiver.state.remote()), weights)
    assert ray.get(broker_of(hub).stats.remote()).peak_buckets <= BUCKETS_IN_FLIGHT


def test_bucketed_with_a_wire_dtype_casts_each_piece(crew):
    hub, receivers = crew
    weights = special_weights(1.5)
    report = to_crew(hub, weights, wire_dtype=torch.bfloat16)
    expected = {k: through_bfloat16(v) for k, v in weights.items()}
    for receiver in receivers:
        assert_bitwise(ray.get(receiver.state.remote()), expected)
    wire_bytes = sum(
        t.numel() * (2 if t.dtype.is_floating_point else t.element_size()) for t in weights.values()
    )
    assert report.bytes == wire_bytes


def test_as_is_sends_one_version_in_its_own_dtypes_on_a_hub_with_a_wire_dtype(actors):
    """``wire_dtype=AS_IS`` on a hub whose default is bfloat16: the version travels in its
    own dtypes, whole or in buckets, and lands bit for bit; the next one without it is
    cast again."""
    hub = start_hub(actors, "object_store", models=[MODEL], wire_dtype=torch.bfloat16)
    receiver = start(actors, Receiver, hub, "r0")
    ready([receiver])
    own_bytes = sum(t.nbytes for t in special_weights().values())
    for seed, bucket_mb in ((1.0, None), (2.0, TINY_MB)):
        weights = special_weights(seed)
        report = ray.get(
            hub.broadcast.remote(weights, model=MODEL, wire_dtype=AS_IS, bucket_mb=bucket_mb),
            timeout=60,
        )
        assert_bitwise(ray.get(receiver.state.remote()), weights)
        assert report.bytes == own_bytes
    weights = special_weights(3.0)
    report = ray.get(hub.broadcast.remote(weights, model=MODEL), timeout=60)
    assert_bitwise(
        ray.get(receiver.state.remote()), {k: through_bfloat16(v) for k, v in weights.items()}
    )
    assert report.bytes < own_bytes


def test_no_reader_sees_bucket_k_of_one_version_beside_another_versions(crew):
    hub, receivers = crew
    versions = [to_crew(hub, uniform_weights(float(value))).version for value in range(1, 9)]
    for receiver in receivers:
        applied = ray.get(receiver.applied_versions.remote())[-8:]
        assert [v for v, _ in applied] == versions
        assert all(uniform for _, uniform in applied), applied


def at_version_one(actors, *workers: str, transport: str = "object_store") -> tuple:
    """A bucketed hub and receivers ``workers``, all holding ``special_weights(1.0)``."""
    hub = start_hub(actors, transport, models=[MODEL], bucket_mb=TINY_MB)
    receivers = [start(actors, Receiver, hub, worker) for worker in workers]
    ready(receivers)
    ray.get(hub.broadcast.remote(special_weights(1.0), model=MODEL), timeout=60)
    return hub, *receivers


@pytest.mark.parametrize("transport", ["object_store", "nixl"])
def test_a_receiver_that_holds_the_others_up_fails_alone(actors, transport):
    """On ``nixl`` the learner writes its ring's slots again once the stuck receiver is
    dropped: the stuck one must not read them later."""
    hub, quick, stuck = at_version_one(actors, "quick", "stuck", transport=transport)

    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, stuck, gate)  # its delivery waits behind this
    weights = special_weights(2.0)
    report = ray.get(
        hub.broadcast.remote(weights, model=MODEL, timeout_s=2.0, raise_on_failure=False),
        timeout=60,
    )
    assert report.acked == ("quick",)
    assert set(report.failed) == {"stuck"}
    assert_bitwise(ray.get(quick.state.remote()), weights)
    ray.get(gate.open.remote())
    ray.get(blocked)
    # Its delivery ran after the stream went on without it: nothing of it was applied.
    assert ray.get(stuck.version.remote()) == 1
    assert_bitwise(ray.get(stuck.state.remote()), special_weights(1.0))
    # And it takes the next version.
    weights = special_weights(3.0)
    report = ray.get(hub.broadcast.remote(weights, model=MODEL), timeout=60)
    assert report.acked == ("quick", "stuck")
    assert_bitwise(ray.get(stuck.state.remote()), weights)


def test_a_frozen_rpc_receiver_holds_no_one_up(actors):
    """An ``rpc`` receiver whose process stopped (not dead: its RPC calls neither land
    nor fail) made the agent wait its RPC timeout for each bucket, while the others
    waited as long for the next one: they failed too. The agent now leaves a receiver
    that takes a bucket no quicker than half that timeout behind."""
    import signal

    hub = start_hub(
        actors, "rpc", models=[MODEL], bucket_mb=TINY_MB, options=RpcOptions(timeout_s=6.0)
    )
    quick, frozen = (start(actors, Receiver, hub, w) for w in ("quick", "frozen"))
    ready([quick, frozen])
    ray.get(hub.broadcast.remote(special_weights(1.0), model=MODEL), timeout=60)
    pid = actor_pid(frozen)
    os.kill(pid, signal.SIGSTOP)
    try:
        weights = special_weights(2.0)
        sent = hub.broadcast.remote(weights, model=MODEL, timeout_s=10.0, raise_on_failure=False)
        report = ray.get(sent, timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert report.acked == ("quick",) and set(report.failed) == {"frozen"}, report.failed
    assert_bitwise(ray.get(quick.state.remote()), weights)


@pytest.mark.parametrize("transport", ["object_store", "nixl"])
def test_a_receiver_that_gives_a_version_up_holds_no_one_up(actors, transport):
    """A reader that cannot read a bucketed version tells the broker at once: the
    learner and the other reader go on instead of waiting half the version's timeout
    (60 s here) for it to take its buckets."""
    hub, quick, failing = at_version_one(actors, "quick", "failing", transport=transport)
    ray.get(failing.fail_next_fetch.remote())
    weights = special_weights(2.0)
    # In a learner actor: the broadcast call itself returns once every bucket is put.
    learner = start(actors, Learner, hub)
    sent = learner.report.remote(weights, timeout_s=120.0, raise_on_failure=False)
    report = ray.get(sent, timeout=30)  # waiting for the stall would take 60 s
    assert report.acked == ("quick",) and set(report.failed) == {"failing"}
    assert "(injected)" in report.failed["failing"]
    assert_bitwise(ray.get(quick.state.remote()), weights)
    assert ray.get(failing.version.remote()) == 1
    weights = special_weights(3.0)  # and it reads the next one
    report = ray.get(hub.broadcast.remote(weights, model=MODEL), timeout=60)
    assert report.acked == ("failing", "quick")
    assert_bitwise(ray.get(failing.state.remote()), weights)


def test_a_broadcast_whose_second_hand_off_fails_lets_go_of_the_first(actors, monkeypatch):
    """Receivers read by nixl and by the object store: the learner hands the version to
    each, nixl first. The object store's hand-off fails: nixl's, already made, is let go
    (it kept the learner's tensors for a stream nothing would ever write), and the next
    version reaches both."""
    hub = start_hub(actors, "object_store", models=[MODEL], bucket_mb=TINY_MB)
    receivers = [
        start(actors, Receiver, hub, "os"),
        start(actors, Receiver, hub, "nx", transport="nixl"),
    ]
    ready(receivers)
    ray.get(hub.broadcast.remote(special_weights(1.0), model=MODEL), timeout=60)

    def no_room(*args, **kwargs):
        raise MemoryError("no room for the stream")

    monkeypatch.setattr(ObjectStoreSender, "send_buckets", no_room)
    with pytest.raises(MemoryError):
        hub.broadcast.remote(special_weights(2.0), model=MODEL)
    monkeypatch.undo()
    assert hub._sender("nixl")._outgoing == {}
    weights = special_weights(3.0)
    report = ray.get(hub.broadcast.remote(weights, model=MODEL), timeout=60)
    assert report.acked == ("nx", "os")
    for receiver in receivers:
        assert_bitwise(ray.get(receiver.state.remote()), weights)


def test_a_hand_off_nobody_reads_holds_no_other_back(actors):
    """An object-store hub whose one receiver reads by shared memory: the learner hands
    a bucketed version over twice (the hub's own hand-off, and shared memory's), one
    stream after the other. Nobody reads the first; the learner waited for its readers
    until the timeout, and the receiver of the second failed every version."""
    hub = start_hub(actors, "object_store", models=[MODEL], bucket_mb=TINY_MB)
    receiver = start(actors, Receiver, hub, "s", transport="shared_memory")
    ready([receiver])
    for value in (1.0, 2.0, 3.0):
        weights = special_weights(value)
        report = ray.get(hub.broadcast.remote(weights, model=MODEL, timeout_s=10), timeout=60)
        assert report.acked == ("s",)
        assert_bitwise(ray.get(receiver.state.remote()), weights)


@pytest.mark.parametrize("copier_transport", ["object_store", "rpc"])
def test_a_version_whose_learner_dies_midway_leaves_every_model_untouched(actors, copier_transport):
    """ "stuck" holds the stream at two buckets; "copier" copies both — itself, or through
    RPC's agent, both reading one stream — and waits for the third, which never comes:
    the learner is killed there. Nothing of the version reaches either model, and its
    readers hear of the death at once (the broker watches the learner's actor) instead
    of waiting out the version's timeout (120 s here)."""
    hub = start_hub(actors, "object_store", models=[MODEL], bucket_mb=TINY_MB)
    copier = start(actors, Receiver, hub, "copier", transport=copier_transport)
    stuck = start(actors, Receiver, hub, "stuck")
    ready([copier, stuck])
    ray.get(hub.broadcast.remote(special_weights(1.0), model=MODEL), timeout=60)

    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, stuck, gate)
    learner = start(actors, Learner, hub)
    learner.send.remote(special_weights(2.0), timeout_s=120.0)
    broker = _wait_for_broker(hub)
    reader = "copier"
    if copier_transport == "rpc":
        reader = ray.get(ray.get_actor(agent_name(hub.config.hub_id)).describe.remote()).reader
    wait_until(lambda: _copier_waits_for_bucket(broker, reader, BUCKETS_IN_FLIGHT))
    ray.kill(learner)
    ray.get(gate.open.remote())
    ray.get(blocked)

    for receiver in (copier, stuck):
        # A reader still waiting for the third bucket would hold this call for 120 s.
        assert ray.get(receiver.version.remote(), timeout=30) == 1
        assert_bitwise(ray.get(receiver.state.remote()), special_weights(1.0))
    weights = special_weights(3.0)
    report = ray.get(hub.broadcast.remote(weights, model=MODEL), timeout=60)
    assert (report.acked, report.version) == (("copier", "stuck"), 3)
    for receiver in (copier, stuck):
        assert_bitwise(ray.get(receiver.state.remote()), weights)


def test_a_learner_dying_before_its_first_bucket_holds_the_next_version_up_no_longer(actors):
    """The learner's version reached the hub, and the learner died putting bucket 0: the
    broker never heard from it, so did not watch it, and the receivers waited for
    bucket 0 the whole stream's wait (here 120 s) while the next learner's version
    queued behind, and failed at its 30 s timeout. The stream's id names its learner:
    the broker watches it from the hub's plan on."""
    hub = start_hub(actors, "object_store", models=[MODEL], bucket_mb=TINY_MB)
    receivers = [start(actors, Receiver, hub, worker) for worker in CREW]
    ready(receivers)
    ray.get(hub.broadcast.remote(special_weights(1.0), model=MODEL), timeout=60)
    dying = start(actors, LearnerDyingAtItsFirstBucket, hub)
    dying.send.remote(special_weights(2.0), timeout_s=120.0)
    wait_dead(dying)
    weights = special_weights(3.0)
    report = ray.get(hub.broadcast.remote(weights, model=MODEL, timeout_s=30.0), timeout=90)
    assert report.acked == CREW
    for receiver in receivers:
        assert_bitwise(ray.get(receiver.state.remote()), weights)


def test_a_zero_copy_shared_memory_model_lives_in_its_staging_buffer_then_in_a_slot(actors):
    """A bucketed version gives a zero-copy model a private staging buffer to live in;
    a whole one (a larger bucket size for that broadcast) a read-only slot again."""
    hub = start_hub(actors, "shared_memory", models=[MODEL], bucket_mb=TINY_MB)
    zero_copy = start(actors, Receiver, hub, "zc", zero_copy=True)
    copying = start(actors, Receiver, hub, "copy")
    ready([zero_copy, copying])
    for seed, bucket_mb in ((1.0, None), (2.0, None), (3.0, 1.0), (4.0, None)):
        weights = special_weights(seed)
        report = ray.get(
            hub.broadcast.remote(weights, model=MODEL, bucket_mb=bucket_mb), timeout=60
        )
        assert report.acked == ("copy", "zc")
        for receiver in (zero_copy, copying):
            assert_bitwise(ray.get(receiver.state.remote()), weights)


def test_a_distributed_member_that_dies_midway_fails_alone(actors):
    """Rank 0 relays buckets 0 and 1 by collective and waits for bucket 2 ("stuck", an
    object-store reader of the same stream, holds it up); a member dies there. A later
    collective fails; the survivor reads that bucket and the rest from the broker."""
    hub = start_hub(actors, "object_store", models=[MODEL], bucket_mb=TINY_MB)
    survivor = start(actors, Receiver, hub, "survivor", transport="distributed")
    doomed = start(actors, Receiver, hub, "doomed", transport="distributed")
    stuck = start(actors, Receiver, hub, "stuck")
    ready([survivor, doomed, stuck])
    doomed_pid = actor_pid(doomed)
    ray.get(hub.broadcast.remote(special_weights(1.0), model=MODEL), timeout=60)

    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, stuck, gate)
    weights = special_weights(2.0)
    learner = start(actors, Learner, hub)
    sent = learner.report.remote(weights, timeout_s=16.0, raise_on_failure=False)
    broker = _wait_for_broker(hub)
    reader = rank0_reader(hub.config.hub_id)
    wait_until(lambda: _copier_waits_for_bucket(broker, reader, BUCKETS_IN_FLIGHT))
    ray.kill(doomed)
    wait_process_exit(doomed_pid)  # not just reported dead: out of every collective
    ray.get(gate.open.remote())
    ray.get(blocked)

    report = ray.get(sent, timeout=60)
    assert report.acked == ("stuck", "survivor")
    assert set(report.failed) == {"doomed"}
    for receiver in (survivor, stuck):
        assert ray.get(receiver.version.remote()) == 2
        assert_bitwise(ray.get(receiver.state.remote()), weights)
    status = ray.get(ray.get_actor(process_group_name(hub.config.hub_id)).describe.remote())
    # A collective after the death failed (the first, unless a send to the dead member
    # still fit in its socket's buffer): the survivor read the rest from the broker.
    assert any("(bucket " in failure for failure in status.failures), status.failures


def test_a_distributed_member_that_forwards_to_a_busy_one_does_not_fail_with_it(actors):
    """gloo broadcasts down a binomial tree: with four ranks, rank 1 ("a") passes each
    bucket on to rank 3 ("z"). "z" is busy in a user method: "a" got every bucket it
    was sent, and must not fail because its send to "z" did (nor "b", rank 2)."""
    options = DistributedOptions(timeout_s=4)
    hub = start_hub(actors, "distributed", models=[MODEL], bucket_mb=TINY_MB, options=options)
    members = [start(actors, Receiver, hub, worker) for worker in ("a", "b", "z")]
    ready(members)
    ray.get(hub.broadcast.remote(special_weights(1.0), model=MODEL), timeout=60)
    a, b, z = members

    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, z, gate)
    weights = special_weights(2.0)
    ref = hub.broadcast.remote(weights, model=MODEL, timeout_s=12.0, raise_on_failure=False)
    report = ray.get(ref, timeout=60)
    assert report.acked == ("a", "b") and set(report.failed) == {"z"}, report.failed
    for receiver in (a, b):
        assert_bitwise(ray.get(receiver.state.remote()), weights)
    ray.get(gate.open.remote())
    ray.get(blocked)
    weights = special_weights(3.0)
    report = ray.get(hub.broadcast.remote(weights, model=MODEL), timeout=60)
    assert report.acked == ("a", "b", "z")
    for receiver in members:
        assert_bitwise(ray.get(receiver.state.remote()), weights)


@pytest.mark.parametrize("transport", ["rpc", "distributed"])
def test_a_relayed_receiver_that_dies_fails_alone(actors, transport):
    hub = start_hub(actors, transport, models=[MODEL], bucket_mb=TINY_MB)
    survivors = [start(actors, Receiver, hub, f"r{i}") for i in range(2)]
    doomed = start(actors, Receiver, hub, "doomed")
    ready([*survivors, doomed])
    ray.get(hub.broadcast.remote(special_weights(1.0), model=MODEL), timeout=60)
    ray.kill(doomed)  # the hub may or may not have noticed by the next broadcast
    weights = special_weights(2.0)
    report = ray.get(hub.broadcast.remote(weights, model=MODEL, raise_on_failure=False), timeout=60)
    assert report.acked == ("r0", "r1"), "\n".join(
        f"{w}: {why}" for w, why in report.failed.items()
    )
    assert set(report.failed) <= {"doomed"}
    for receiver in survivors:
        assert_bitwise(ray.get(receiver.state.remote()), weights)


@BUCKETED
def test_late_joiners_and_restarted_receivers_start_on_the_latest_version(actors, transport):
    """Between broadcasts no process holds a bucketed version whole but the receivers'
    models: a receiver that joins, or comes back after a restart, reads it from one of
    them."""
    hub = start_hub(actors, transport, models=[MODEL], bucket_mb=TINY_MB)
    holder = start(actors, Receiver, hub, "holder")
    restarting = start(actors, Receiver.options(max_restarts=1), hub, "restarting")
    ready([holder, restarting])
    for seed in (1.0, 2.0):
        latest = special_weights(seed)
        ray.get(hub.broadcast.remote(latest, model=MODEL), timeout=60)

    late = start(actors, Receiver, hub, "late")
    assert ray.get(late.version.remote()) == 2  # before its first call returns
    assert_bitwise(ray.get(late.state.remote()), latest)

    old_pid = actor_pid(restarting)
    ray.kill(restarting, no_restart=False)
    wait_until(lambda: _pid_or_none(restarting) not in (None, old_pid))
    assert ray.get(restarting.version.remote()) == 2
    assert_bitwise(ray.get(restarting.state.remote()), latest)

    newest = special_weights(3.0)
    report = ray.get(hub.broadcast.remote(newest, model=MODEL), timeout=60)
    assert report.acked == ("holder", "late", "restarting")
    for receiver in (holder, late, restarting):
        assert_bitwise(ray.get(receiver.state.remote()), newest)


def test_a_late_joiner_whose_only_holder_died_waits_for_the_next_version(actors):
    hub, holder = at_version_one(actors, "holder")
    ray.kill(holder)

    late = start(actors, Receiver, hub, "late")  # connects: nobody can serve version 1
    assert ray.get(late.version.remote(), timeout=30) == 0
    newest = special_weights(2.0)
    report = ray.get(hub.broadcast.remote(newest, model=MODEL, raise_on_failure=False))
    assert "late" in report.acked
    assert_bitwise(ray.get(late.state.remote()), newest)


@ray.remote(num_cpus=0)
class Joiner(ConformanceReceiver):
    """A receiver that notes the version it holds once connected, before any call."""

    def __init__(self, hub, worker_id: str) -> None:
        super().__init__(hub, worker_id)
        self.connected_on = self.version()

    def version_once_connected(self) -> int:
        return self.connected_on


@ray.remote(num_cpus=0)
class MidStreamStaller(ConformanceReceiver):
    def stall_after_bucket(self, index: int, gate, entered) -> None:
        """The next bucketed version it reads stops after bucket ``index`` (the buckets
        below it freed) until the test opens ``gate``; ``entered`` is opened then."""
        from raysync.transports.object_store import buckets

        every = buckets.buckets_of

        def stalling(payload, count, worker):
            for bucket in every(payload, count, worker):
                yield bucket
                if bucket[0] == index:
                    buckets.buckets_of = every
                    ray.get(entered.open.remote())
                    ray.get(gate.wait.remote())

        buckets.buckets_of = stalling


def test_a_receiver_joining_while_a_version_streams_starts_on_it(actors):
    """Versions streamed back to back: a receiver always joins while one streams, whose
    first buckets its readers took and freed already. The joiner waits for a reader to
    take it whole and is served that one's copy inside its connect (it started on
    nothing: its read of the stream found bucket 0 gone)."""
    hub = start_hub(actors, "object_store", models=[MODEL], bucket_mb=TINY_MB)
    holder = start(actors, MidStreamStaller, hub, "holder")
    ready([holder])
    ray.get(hub.broadcast.remote(special_weights(1.0), model=MODEL), timeout=60)
    gate, entered = start(actors, Gate), start(actors, Gate)
    ray.get(holder.stall_after_bucket.remote(4, gate, entered))
    newest = special_weights(2.0)
    reported = start(actors, Learner, hub).report.remote(newest)
    ray.get(entered.wait.remote(), timeout=60)  # version 2 is half read
    late = start(actors, Joiner, hub, "late")
    wait_until(
        lambda: "late" in {r.worker for r in ray.get(hub.status.remote()).receivers},
        what="the joiner registered",
    )
    ray.get(gate.open.remote())
    assert ray.get(reported, timeout=60).acked == ("holder",)
    assert ray.get(late.version_once_connected.remote(), timeout=60) == 2
    assert_bitwise(ray.get(late.state.remote()), newest)


@pytest.mark.parametrize("models", [("a", "b"), ("a", "a")], ids=["two models", "one model"])
@RINGS
def test_versions_streamed_at_once_never_wait_for_each_other(actors, transport, models):
    """A learner's two threads stream two versions (of two models, or of one) out of
    its registered bucket slots to a receiver that reads them one at a time, in the
    hub's order. Streamed in the other order out of one ring, the second waited for
    that receiver, which waited for the first (until the broker dropped the receiver
    from the second, which failed)."""
    rdt = transport == "rdt"
    hub = start_hub(actors, transport, models=["a", "b"], bucket_mb=TINY_MB, timeout_s=10.0)
    versions = [
        (model, special_weights(seed)) for model, seed in zip(models, (1.0, 2.0), strict=True)
    ]
    holder = start(actors, RdtPairHolder if rdt else PairHolder, hub, versions[0][1], "both")
    learner = start(actors, RdtCrossingLearner if rdt else CrossingLearner, hub)
    ready([holder])
    refs = ray.get(
        learner.crossed.remote(
            versions, f"raysync.transports.{transport}.ring", "RdtRing" if rdt else "BucketRing", 30
        ),
        timeout=60,
    )
    reports = [ray.get(ref, timeout=60) for ref in refs]
    assert [r.acked for r in reports] == [("both",), ("both",)], [r.failed for r in reports]
    for model, weights in dict(versions).items():  # each model's last version
        assert_bitwise(ray.get(holder.state.remote(model)), weights)


@RINGS
def test_a_send_waiting_for_its_buffer_lets_another_models_version_stream(
    actors, transport, monkeypatch
):
    """Two models broadcast from two threads of the learner (this process): the receiver
    is reading model b's bucketed version when a's third send waits for a's first
    broadcast (its buffer's last), which the receiver can end only after b's. b streams
    meanwhile (``send`` waited under the lock ``submitted`` takes: b never streamed, and
    failed at its timeout)."""
    rdt = transport == "rdt"
    hub = start_hub(actors, transport, models=["a", "b"], timeout_s=10.0)
    template = special_weights(0.0)
    holder = start(actors, RdtPairHolder if rdt else PairHolder, hub, template, "both")
    ready([holder])
    sender = RdtSender if rdt else NixlSender
    submitted, wait = sender.submitted, hub_handle._BroadcastDone.wait
    b_at_hub, a_waits = threading.Event(), threading.Event()

    def submitting(this, payload, done):
        if threading.current_thread().name == "b":
            b_at_hub.set()
            assert a_waits.wait(30), "a's third send never waited for its first broadcast"
        return submitted(this, payload, done)

    def waiting(this, timeout_s):
        if threading.current_thread().name == "a":
            a_waits.set()
        return wait(this, timeout_s)

    monkeypatch.setattr(sender, "submitted", submitting)
    monkeypatch.setattr(hub_handle._BroadcastDone, "wait", waiting)
    versions = {"a": [special_weights(s) for s in (1.0, 2.0, 3.0)], "b": [special_weights(4.0)]}
    refs: dict[str, list] = {}

    def send(model: str) -> None:
        if model == "a":  # once the holder reads b's version (asked for buckets 0 and 1)
            assert b_at_hub.wait(30), "b's broadcast never reached the hub"
            broker = _wait_for_broker(hub)
            wait_until(lambda: _copier_waits_for_bucket(broker, "both", 1), what="b read")
        refs[model] = [
            hub.broadcast.remote(w, model=model, bucket_mb=TINY_MB if model == "b" else None)
            for w in versions[model]
        ]

    threads = [threading.Thread(target=send, args=(m,), name=m) for m in "ba"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    reports = ray.get([ref for m in "ba" for ref in refs[m]], timeout=60)
    assert [r.acked for r in reports] == [("both",)] * 4, [r.failed for r in reports]
    for model in "ab":
        assert_bitwise(ray.get(holder.state.remote(model)), versions[model][-1])


def test_sharded_learners_each_stream_their_own_part(crew, actors):
    """And a receiver that joins afterwards reads each part from one that holds it."""
    hub, receivers = crew
    learners = [start(actors, ShardLearner, hub) for _ in range(2)]
    version = ray.get(hub.status.remote()).versions.get(MODEL, 0) + 5  # a version it skips to
    weights = special_weights(4.0)
    parts = split_in_parts(weights, 2)
    reports = ray.get(
        [
            learner.send.remote(
                part, version=version, part=i, parts=2, workers=CREW, wire_dtype=torch.bfloat16
            )
            for i, (learner, part) in enumerate(zip(learners, parts, strict=True))
        ],
        timeout=60,
    )
    assert {r.version for r in reports} == {version}
    assert reports[0].acked == CREW
    expected = {k: through_bfloat16(v) for k, v in weights.items()}
    late = start(actors, Receiver, hub, "late")
    for receiver in [*receivers, late]:
        assert ray.get(receiver.version.remote()) == version
        assert_bitwise(ray.get(receiver.state.remote()), expected)


def test_a_bucketing_hubs_broker_starts_with_the_hub_and_ends_with_it(actors):
    """A hub with a ``bucket_mb`` starts its broker itself (its first bucketed broadcast
    does not wait for the process); the broker is detached from the learners that use
    it, and the hub's end, closed or dead, is its: also a hub that dies before any
    bucketed version went through its broker."""
    brokers = []
    for end in ("close", "kill", "kill at once"):
        hub = start_hub(actors, "object_store", models=[MODEL], bucket_mb=TINY_MB)
        if end == "kill at once":  # dead right after its __init__ opened the broker
            ready([hub.actor])
            brokers.append(broker_of(hub))
            ray.kill(hub.actor)
            continue
        receiver = start(actors, Receiver, hub, f"r-{end}")
        ready([receiver])  # registered: the hub's __init__ is done
        broker = broker_of(hub)  # before any broadcast
        ray.get(hub.broadcast.remote(special_weights(1.0), model=MODEL), timeout=60)
        assert broker_of(hub)._actor_id == broker._actor_id  # the learner found it
        brokers.append(broker)
        if end == "close":
            ray.get(hub.close.remote())
        else:
            ray.kill(hub.actor)
    for broker in brokers:
        wait_dead(broker, timeout_s=30)  # it looks at its hub every few seconds


@pytest.mark.parametrize("transport", ["object_store", "nixl"])
def test_a_bucket_broker_that_died_is_replaced_for_the_next_version(actors, transport):
    """The broker is a detached actor Ray does not restart: one that died between two
    bucketed versions (its node lost, an OOM kill) is started again by the learner."""
    hub, *receivers = at_version_one(actors, "r0", "r1", transport=transport)
    broker = broker_of(hub)
    ray.kill(broker)
    wait_dead(broker)
    weights = special_weights(2.0)
    report = ray.get(hub.broadcast.remote(weights, model=MODEL), timeout=60)
    assert report.acked == ("r0", "r1")
    for receiver in receivers:
        assert_bitwise(ray.get(receiver.state.remote()), weights)
    assert broker_of(hub)._actor_id != broker._actor_id


def test_the_bucket_broker_never_imports_torch(crew, actors):
    """The broker hands out buckets and never opens one: its process moves whole and
    bucketed versions of every transport, from a learner actor, without importing torch
    (three seconds of CPU and a few hundred MB on each start). It did, unpickling the
    learner's actor handle (Ray imports an actor's class for that) or a NIXL ring's
    bucket, and the hub's first bucketed plan waited 1.7-2.5 s for it. The hub's
    process cannot be as lean: Ray imports a receiver's class, and so torch, to
    unpickle its actor handle at the receiver's registration."""
    hub, receivers = crew
    learner = start(actors, Learner, hub)
    bucketed = ray.get(learner.report.remote(special_weights(1.0), workers=CREW), timeout=60)
    whole = to_crew(hub, special_weights(2.0), bucket_mb=1024)
    assert (bucketed.acked, whole.acked) == (CREW, CREW)
    for receiver in receivers:
        assert_bitwise(ray.get(receiver.state.remote()), special_weights(2.0))
    # By value, not a function of this module: the broker must not import this module.
    imported_torch = lambda _: "torch" in __import__("sys").modules  # noqa: E731
    assert ray.get(broker_of(hub).__ray_call__.remote(imported_torch)) is False


@ray.remote(num_cpus=0, num_gpus=1, enable_tensor_transport=True)
class CudaReceiver(WeightReceiver):
    """A model in VRAM: buckets are staged on the host, copied to the device at the
    safe point (``object_store``), or READ into VRAM staging (``nixl``, ``rdt``)."""

    def __init__(self, hub, worker: str):
        self.sd = {k: torch.zeros_like(v, device="cuda") for k, v in special_weights().items()}
        self.connect_hub(hub, models={MODEL: "sd"}, worker_id=worker)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in self.sd.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["object_store", "nixl", "rdt"])
def test_a_cuda_learner_streams_buckets_to_a_cuda_receiver(actors, transport):
    """``object_store``: host buckets, copied to the device at the safe point; ``nixl``
    and ``rdt``: the learner packs on its device into a VRAM ring, the receiver READs
    into VRAM (its own agent, or Ray's)."""
    if ray.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the receiver needs a GPU of its own")
    hub = start_hub(actors, transport, models=[MODEL], bucket_mb=TINY_MB)
    receiver = start(actors, CudaReceiver, hub, "gpu0")
    ready([receiver])
    weights = special_weights(3.0)
    on_device = {k: v.cuda() for k, v in weights.items()}
    report = ray.get(
        hub.broadcast.remote(on_device, model=MODEL, wire_dtype=torch.bfloat16), timeout=60
    )
    assert report.acked == ("gpu0",)
    # Cast where raysync casts, on the learner's device: CUDA writes a NaN as bfloat16
    # 0x7FFF where the CPU writes 0x7FC0 (seen on an H100: f32's NaN differed).
    expected = {k: through_bfloat16(v).cpu() for k, v in on_device.items()}
    assert_bitwise(ray.get(receiver.state.remote()), expected)


def test_bucket_mb_is_refused_where_a_transport_moves_whole_versions(actors):
    """Every built-in transport moves buckets; one written outside raysync that does not
    declare ``buckets`` is refused by name, at the hub's start and in the learner (a
    receiver reading through it on a bucketed hub), before anything is sent."""
    register_transport("packed_object", PackedObjectTransport)
    with pytest.raises(ValueError, match="bucket_mb: transport 'packed_object' moves whole"):
        start_hub(actors, "packed_object", bucket_mb=1)
    with pytest.raises(ValueError, match="bucket_mb must be a positive number of MiB"):
        start_hub(actors, "object_store", bucket_mb=0)
    hub = start_hub(actors, "object_store", models=[MODEL])
    receiver = start(actors, Receiver, hub, "r0", transport="packed_object")
    ready([receiver])
    with pytest.raises(ValueError, match=r"transport 'packed_object' moves whole versions"):
        ray.get(hub.broadcast.remote(special_weights(1.0), model=MODEL, bucket_mb=TINY_MB))
    assert ray.get(receiver.version.remote()) == 0


def test_a_bucketing_hub_refuses_a_receiver_of_a_whole_version_transport(actors):
    """Taken in, its hand-off joined every broadcast: each above the hub's bucket_mb,
    from every learner, was refused (``workers=`` leaving it out too), saying to
    broadcast without bucket_mb, which takes the hub's. It is refused as it registers,
    by name; the hub's other receivers get every version."""
    register_transport("packed_object", PackedObjectTransport)
    hub = start_hub(actors, "object_store", models=[MODEL], bucket_mb=TINY_MB)
    whole = start(actors, Receiver, hub, "whole", transport="packed_object")
    refusal = r"bucket_mb: transport 'packed_object' moves whole versions only, and this hub"
    with pytest.raises(ray.exceptions.RayActorError, match=refusal):
        ready([whole])
    bucketed = start(actors, Receiver, hub, "bucketed")
    ready([bucketed])
    report = ray.get(hub.broadcast.remote(special_weights(1.0), model=MODEL), timeout=60)
    assert (report.acked, report.failed) == (("bucketed",), {})
    assert_bitwise(ray.get(bucketed.state.remote()), special_weights(1.0))
    status = ray.get(hub.status.remote())
    assert [r.worker for r in status.receivers] == ["bucketed"]
    assert "started with bucket_mb=" in status.refused["whole"].error


def test_the_hub_refuses_a_bucketed_version_for_receivers_of_a_whole_version_transport(actors):
    """``put_reader`` reads the object store's hand-off, which moves buckets, but reads
    whole puts only: the hub names its receivers before any receiver is touched."""
    register_transport("put_reader", PutReaderTransport)
    hub = start_hub(actors, "object_store", models=[MODEL])
    whole = start(actors, Receiver, hub, "whole", transport="put_reader")
    bucketed = start(actors, Receiver, hub, "bucketed")
    ready([whole, bucketed])
    with pytest.raises(ValueError, match=r"whole versions only: whole \(put_reader\)"):
        ray.get(hub.broadcast.remote(special_weights(1.0), model=MODEL, bucket_mb=TINY_MB))
    assert [ray.get(r.version.remote()) for r in (whole, bucketed)] == [0, 0]
    report = ray.get(hub.broadcast.remote(special_weights(2.0), model=MODEL), timeout=60)
    assert report.acked == ("bucketed", "whole")
    assert_bitwise(ray.get(whole.state.remote()), special_weights(2.0))


def _pid_or_none(handle) -> int | None:
    try:
        return actor_pid(handle)
    except ray.exceptions.ActorUnavailableError:
        return None


def _wait_for_broker(hub, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return broker_of(hub)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _copier_waits_for_bucket(broker, worker: str, index: int) -> bool:
    return ray.get(broker.taken.remote(worker)) >= index


@ray.remote(num_cpus=0)
class _BrokerWhoseTakeRaises:
    """Stands for the hub's bucket broker with a bug in ``take``."""

    def take(self, key, index, worker, passed_on=(), copied=None):
        raise ValueError(f"no bucket {index} here")


def test_a_broker_take_that_raises_names_the_bucket(actors):
    """A Ray error other than the broker's death (its ``take`` raised) reached the
    receiver raw, a remote traceback naming no bucket or stream; it is the stream's end
    now, named like one."""
    broker = _BrokerWhoseTakeRaises.remote()
    actors.append(broker)
    payload = BucketStream(broker, StreamId("s", 2, 5.0), 64)
    with pytest.raises(
        TransportError,
        match=r"bucket 0 of 2: the hub's bucket broker could not answer \(ValueError: no bucket 0",
    ):
        next(buckets_of(payload, 2, "w"))

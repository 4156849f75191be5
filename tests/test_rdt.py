"""The rdt transport (Ray's NIXL tensor transport): delivery, the actor requirement, kills."""

from __future__ import annotations

import logging
import threading

import pytest
import ray
import torch

from raysync.transports.base import VersionDone
from raysync.transports.rdt import RdtTransport
from raysync.transports.rdt import learner as rdt_learner
from tests.helpers import (
    Gate,
    assert_same,
    cpu_seconds_over_one_idle_second,
    hold_until_opened,
    ready,
    start,
    start_hub,
    wait_until,
)
from tests.nixl_actors import (
    Learner,
    RdtAsyncHolder,
    RdtBigCollector,
    RdtCollector,
    RdtHashingCollector,
    RdtHolder,
    RdtLearner,
    big_model,
    digest,
    nixl_level_once_rays_agent_is_made,
    set_rays_rdt_fetch_limit,
    staging_set_aside,
    stall_next_rdt_read,
)
from tests.receivers import Collector, make_policy, state_of

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(
        not RdtTransport.availability().available,
        reason=f"rdt unavailable: {RdtTransport.availability().reason}",
    ),
]


def _report(hub, ticket, timeout_s: float):
    return ray.get(hub.wait_for.remote(ticket, raise_on_failure=False), timeout=timeout_s)


def test_receiver_without_tensor_transport_is_refused_with_what_to_add(actors):
    hub = start_hub(actors, "rdt")
    plain = start(actors, Collector, hub)
    with pytest.raises(ray.exceptions.RayActorError, match="enable_tensor_transport=True"):
        ray.get(plain.__ray_ready__.remote())


def test_learner_actor_without_tensor_transport_is_refused(actors):
    hub = start_hub(actors, "rdt")
    learner = start(actors, Learner, hub)
    with pytest.raises(ray.exceptions.RayTaskError, match="enable_tensor_transport=True"):
        ray.get(learner.broadcast.remote(1.0, 10))


def test_every_version_bitwise_late_join_and_pull(actors):
    hub = start_hub(actors, "rdt")
    push = [start(actors, RdtCollector, hub) for _ in range(2)]
    pull = start(actors, RdtCollector, hub, worker_id="pull", mode="pull")
    ready([*push, pull])
    learner = make_policy()
    for step in range(1, 4):
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(torch.randn_like(p))
        report = ray.get(hub.broadcast.remote(learner))
        assert report.version == step and len(report.acked) == 2
        for receiver in push:
            assert_same(ray.get(receiver.state.remote()), state_of(learner))
    late = start(actors, RdtCollector, hub)
    assert_same(ray.get(late.state.remote()), state_of(learner))
    assert ray.get(pull.pull.remote()) == {"policy": 3}
    assert_same(ray.get(pull.state.remote()), state_of(learner))


def test_bucketed_versions_bitwise_wire_dtype_and_late_join(actors):
    """1 KiB buckets (the policy's ~2.6 KB in three), each an RDT object out of the
    learner's two slots: every version lands bitwise (through bfloat16 too), back to
    back, and a late joiner reads the latest from a receiver that holds it."""
    hub = start_hub(actors, "rdt", bucket_mb=1 / 1024)
    receivers = [start(actors, RdtCollector, hub) for _ in range(2)]
    ready(receivers)
    learner = make_policy()
    for step in range(1, 5):
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(torch.randn_like(p))
        report = ray.get(hub.broadcast.remote(learner), timeout=60)
        assert report.version == step and len(report.acked) == 2
        for receiver in receivers:
            assert_same(ray.get(receiver.state.remote()), state_of(learner))
    report = ray.get(hub.broadcast.remote(learner, wire_dtype=torch.bfloat16), timeout=60)
    through_bf16 = {k: v.to(torch.bfloat16).float() for k, v in state_of(learner).items()}
    for receiver in receivers:
        assert_same(ray.get(receiver.state.remote()), through_bf16)
    late = start(actors, RdtCollector, hub)
    assert_same(ray.get(late.state.remote()), through_bf16)


def test_back_to_back_broadcasts_never_tear(actors):
    hub = start_hub(actors, "rdt")
    receivers = [start(actors, RdtHashingCollector, hub) for _ in range(2)]
    ready(receivers)
    sent, tickets = {}, []
    for _ in range(10):
        weights = state_of(make_policy())
        ticket = ray.get(hub.broadcast.remote(weights, wait=False))
        sent[ticket.version] = digest(weights)
        tickets.append(ticket)
    reports = [ray.get(hub.wait_for.remote(t, raise_on_failure=False), timeout=60) for t in tickets]
    assert all(r.failed == {} for r in reports), [r.failed for r in reports if r.failed]
    for receiver in receivers:
        seen = ray.get(receiver.seen.remote())
        assert max(seen) == max(sent)
        assert all(sent[v] == d for v, d in seen.items())


def test_killed_learner_fails_the_broadcast_within_the_timeout(actors):
    hub = start_hub(actors, "rdt")
    receivers = [start(actors, RdtBigCollector, hub) for _ in range(2)]
    ready(receivers)
    learner = start(actors, RdtLearner, hub)
    first = ray.get(learner.broadcast.remote(1.0, 30))
    assert _report(hub, first, 45).ok  # version 1 everywhere: connections are up
    ticket = ray.get(learner.broadcast.remote(2.0, 30))
    ray.kill(learner)
    report = _report(hub, ticket, 45)
    for receiver in receivers:
        version, low, high = ray.get(receiver.summary.remote())
        assert (version, low, high) in ((1, 1.0, 1.0), (2, 2.0, 2.0))
    assert report.failed or len(report.acked) == 2
    for reason in report.failed.values():
        assert "TransportError" in reason, reason
    weights = big_model()
    weights["w"].fill_(3.0)
    assert len(ray.get(hub.broadcast.remote(weights, model="big")).acked) == 2


def test_rays_agent_made_by_raysync_prints_no_info_lines(actors):
    """nixl logs "Initialized NIXL agent" at INFO on stdout from every process with an
    agent: as for its own agents, raysync keeps its logger to warnings where it makes
    Ray's (``NIXL_LOG_LEVEL`` set by a user wins)."""
    learner = start(actors, RdtLearner, None)  # it never broadcasts: no hub
    made, level = ray.get(learner.__ray_call__.remote(nixl_level_once_rays_agent_is_made))
    assert made
    assert level >= logging.WARNING, f"nixl's logger is at {logging.getLevelName(level)}"


def test_no_rdt_process_spins_a_core_while_idle(actors):
    """Ray makes its NIXL agent with nixl's progress thread, which spins a core for the
    process's life; raysync makes Ray's agent itself, progressed from a sleeping thread.
    (A spinning thread burns ~1 s of CPU per idle second; the bound leaves room.)"""
    hub = start_hub(actors, "rdt")
    receiver = start(actors, RdtBigCollector, hub, worker_id="idle")
    ready([receiver])
    learner = start(actors, RdtLearner, hub)
    for value in (1.0, 2.0):  # the second reuses the connection and the first buffer
        report = _report(hub, ray.get(learner.broadcast.remote(value, 30)), 45)
        assert report.acked == ("idle",) and report.failed == {}, report
    assert ray.get(receiver.summary.remote()) == (2, 2.0, 2.0)
    for name, actor in (("learner", learner), ("receiver", receiver)):
        cpu = ray.get(actor.__ray_call__.remote(cpu_seconds_over_one_idle_second))
        assert cpu < 0.5, f"the {name} burned {cpu:.2f} s of CPU in one idle second"


def test_a_receiver_busy_past_its_timeouts_does_not_stall_the_learner(actors, monkeypatch):
    """A receiver busy in a user method past a version's timeout keeps its delivery call
    queued, holding the version's ref (the hub makes it no other call meanwhile): the
    learner's third version, which reuses the first's buffer, sets that buffer aside
    for it instead of waiting (it waited REUSE_WAIT_S, 600 s by default, then failed
    the version for everyone). Free again, it is sent the latest version."""
    monkeypatch.setattr(rdt_learner, "REUSE_WAIT_S", 30.0)  # the learner is this process
    hub = start_hub(actors, "rdt")
    template = state_of(make_policy())
    quick, busy = (start(actors, RdtHolder, hub, template, w) for w in ("quick", "busy"))
    ready([quick, busy])
    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, busy, gate)
    for _ in range(4):
        weights = state_of(make_policy())
        sent = hub.broadcast.remote(weights, model="m", timeout_s=1.0, raise_on_failure=False)
        report = ray.get(sent, timeout=60)
        assert report.acked == ("quick",) and set(report.failed) == {"busy"}
        assert_same(ray.get(quick.state.remote()), weights)
    ray.get(gate.open.remote())
    ray.get(blocked)
    wait_until(lambda: ray.get(busy.version.remote()) == 4, what="busy holds version 4")
    assert ray.get(busy.applied_versions.remote()) == [1, 4]  # not 2 and 3 in turn
    assert_same(ray.get(busy.state.remote()), weights)
    weights = state_of(make_policy())
    report = ray.get(hub.broadcast.remote(weights, model="m"), timeout=60)
    assert report.acked == ("busy", "quick")
    assert_same(ray.get(busy.state.remote()), weights)


def test_a_read_past_rays_own_fetch_limit_sets_its_buffer_aside(actors):
    """Ray ends an RDT fetch at its own limit (60 s), below the receiver's, and its
    READ may go on: the receiver took that for a lost object, blamed the learner and
    freed the staging buffer, so the next version was read into memory the late READ
    still wrote (a torn version, acked as applied). The buffer is set aside."""
    hub = start_hub(actors, "rdt")
    receiver = start(actors, RdtHolder, hub, state_of(make_policy()), "r")
    ready([receiver])
    ray.get(hub.broadcast.remote(state_of(make_policy()), model="m"))
    ray.get(receiver.__ray_call__.remote(set_rays_rdt_fetch_limit, 0.0))
    report = ray.get(
        hub.broadcast.remote(state_of(make_policy()), model="m", raise_on_failure=False)
    )
    assert set(report.failed) == {"r"}, report
    assert "Ray's own limit is 0 s" in report.failed["r"], report.failed
    assert "may have died" not in report.failed["r"], report.failed  # the learner did not
    assert ray.get(receiver.__ray_call__.remote(staging_set_aside)) == 1
    ray.get(receiver.__ray_call__.remote(set_rays_rdt_fetch_limit, 60.0))
    weights = state_of(make_policy())
    assert ray.get(hub.broadcast.remote(weights, model="m")).acked == ("r",)
    assert_same(ray.get(receiver.state.remote()), weights)


def test_versions_an_async_receiver_defers_hold_no_learner_buffer_once_superseded(
    actors, caplog
):
    """An async receiver in one long method defers each version to its end, and drops
    the older one as a newer one comes (its staging freed). Its ack, which waits for
    the newer one's outcome, still held the version's ObjectRef: the learner's buffer
    of it, which the learner then set aside (a whole model's copy each), until none was
    left and a send waited (REUSE_WAIT_S, 600 s) and failed everyone."""
    hub = start_hub(actors, "rdt")
    busy = start(actors, RdtAsyncHolder, hub, "busy", 0)
    ready([busy])
    ray.get(hub.broadcast.remote(make_policy()))
    entered, leave = start(actors, Gate), start(actors, Gate)
    held = busy.hold.remote(entered, leave)
    ray.get(entered.wait.remote())
    weights = make_policy()
    with caplog.at_level(logging.WARNING, logger=rdt_learner.__name__):
        for _ in range(4):  # each deferred, then superseded by the next
            weights = make_policy()
            report = ray.get(hub.broadcast.remote(weights, timeout_s=1.0, raise_on_failure=False))
            assert set(report.failed) == {"busy"}, report  # not applied within 1 s
    assert hub._side.senders["rdt"]._set_aside == []
    assert "set aside" not in caplog.text
    ray.get(leave.open.remote())
    ray.get(held)
    wait_until(lambda: ray.get(busy.weights_version.remote()) == 5, what="busy holds v5")
    assert_same(ray.get(busy.state.remote()), state_of(weights))


def test_two_models_of_one_spec_broadcast_in_turn_never_wait_for_each_other(actors, caplog):
    """The hub keeps each model's latest version (late joiners read it): with two
    models of one spec, the learner's buffer of one model's latest is not the other's
    to reuse. Each version takes a buffer nobody holds; none is set aside, none waits
    for Ray to free what the hub keeps."""
    hub = start_hub(actors, "rdt")
    template = state_of(make_policy())
    holders = {m: start(actors, RdtHolder, hub, template, f"holds-{m}", m) for m in "ab"}
    ready(list(holders.values()))
    with caplog.at_level(logging.WARNING, logger=rdt_learner.__name__):
        for _ in range(3):
            for model, holder in holders.items():
                weights = state_of(make_policy())
                report = ray.get(hub.broadcast.remote(weights, model=model), timeout=60)
                assert report.acked == (f"holds-{model}",)
                assert_same(ray.get(holder.state.remote()), weights)
    assert [r.getMessage() for r in caplog.records if r.name == rdt_learner.__name__] == []
    late = start(actors, RdtHolder, hub, template, "late", "a")
    assert_same(ray.get(late.state.remote()), ray.get(holders["a"].state.remote()))


def test_a_model_waiting_for_its_buffer_does_not_hold_up_another_models_sends(actors):
    """The learner's third version of model a reuses the buffer of its first, and waits
    for that broadcast to end: its receiver is busy past it. The wait held the sender's
    one lock, so model b's broadcast from another thread of the learner waited for a's
    slow receiver too (up to a's timeout, or REUSE_WAIT_S). It waits under a's own
    buffers' lock now: b goes, a waits."""
    hub = start_hub(actors, "rdt")
    template = state_of(make_policy())
    slow = start(actors, RdtHolder, hub, template, "slow", "a")
    other = start(actors, RdtHolder, hub, template, "other", "b")
    ready([slow, other])
    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, slow, gate)

    def broadcast_a():
        weights = state_of(make_policy())
        return hub.broadcast.remote(weights, model="a", timeout_s=30.0, raise_on_failure=False)

    first, _ = broadcast_a(), broadcast_a()  # a's two buffers, each in a broadcast
    sender = hub._side.senders["rdt"]
    wait_until(lambda: len(sender._broadcasts) == 2, what="a's two versions handed off")
    third: list = []
    waiting = threading.Thread(target=lambda: third.append(broadcast_a()), name="a's third")
    waiting.start()
    wait_until(lambda: len(sender._broadcasts) == 1, what="a's third version waiting")
    weights = state_of(make_policy())
    report = ray.get(hub.broadcast.remote(weights, model="b"), timeout=60)
    assert report.acked == ("other",)
    assert_same(ray.get(other.state.remote()), weights)
    assert ray.wait([first], timeout=0)[0] == [], "b's broadcast waited for a's slow receiver"
    ray.get(gate.open.remote())
    ray.get(blocked)
    waiting.join()
    assert ray.get(third[0], timeout=60).acked == ("slow",)


class _Over(VersionDone):
    """A broadcast that has ended."""

    def wait(self, timeout_s: float) -> None:
        return None


class _Running(VersionDone):
    """A broadcast that goes on."""

    def wait(self, timeout_s: float) -> None:
        raise TimeoutError


def test_a_ring_slot_still_held_when_its_broadcast_ends_is_left_and_its_stream_ends(actors):
    """A bucket slot whose last object a reader still holds (its get timed out while
    queued) is not written again; the learner waited for Ray to free it for
    REUSE_WAIT_S (600 s) inside the broadcast, whether or not the broadcast had ended
    meanwhile. It stops waiting once the broadcast is over (the stream then ends)."""
    ring, held = _ring_whose_first_slot_is_held()
    slot = ring._slots[0]
    view = slot.published
    try:
        assert ring._wait_until_freed(slot, _Over()) is False
        assert slot.published is view  # still held: not written, not forgotten
        del held
        assert ring._wait_until_freed(slot, _Running()) is True
        assert slot.published is None
    finally:
        _deregister(ring)


def _ring_whose_first_slot_is_held() -> tuple:
    """A learner's ring (this process is the learner) whose first slot's object a
    reader still holds: the ring, and that reader's ref (drop it to let the slot go)."""
    ring = rdt_learner._new_ring(1024, torch.device("cpu"))
    slot = ring._slots[0]
    view = slot.tensor[:512]
    held = ray.put([view], _tensor_transport="nixl")
    slot.published = view
    return ring, held


def _deregister(ring) -> None:
    from ray.experimental import deregister_nixl_memory

    for tensor in ring.tensors:
        deregister_nixl_memory(tensor)


def test_a_ring_slot_a_dropped_reader_still_reads_is_set_aside_for_a_new_one(actors):
    """A reader the broker dropped (stalled past its limit) may still be in its get of
    a slot's object, up to Ray's fetch limit (60 s): the learner waited for it, every
    other reader failed at its timeout, and so did the ring's next version. Once the
    broker made room, a slot still referenced a moment later is set aside, and a new
    one takes its place; it is let go once Ray frees it."""
    ring, held = _ring_whose_first_slot_is_held()  # held by the dropped reader
    first = ring._slots[0]
    try:
        fresh = ring._free_slot(0, _Running())
        assert fresh is not None and fresh is not first and fresh.tensor is not first.tensor
        assert ring._slots[0] is fresh and ring._set_aside == [first]
        assert len(ring.tensors) == 3  # the sender deregisters the one set aside too
        ring._let_go_of_freed()
        assert ring._set_aside == [first]  # still held
        del held
        wait_until(lambda: ring._let_go_of_freed() or ring._set_aside == [], what="let go")
        assert len(ring.tensors) == 2
    finally:
        _deregister(ring)


def test_a_reader_stalled_mid_stream_fails_alone_and_the_next_version_goes(actors):
    """A reader stalled inside its get of bucket 0 is dropped by the broker (half the
    timeout), but its get still holds that slot's object: the learner waited for it to
    write bucket 2 there, the other reader failed at its timeout, and so did the next
    version, whose first bucket needed that slot."""
    hub = start_hub(actors, "rdt", bucket_mb=1 / 1024)  # the policy in three buckets
    stalled, healthy = (start(actors, RdtCollector, hub, worker_id=w) for w in ("stalled", "ok"))
    ready([stalled, healthy])
    ray.get(hub.broadcast.remote(make_policy()))
    gate = start(actors, Gate)
    ray.get(stalled.__ray_call__.remote(stall_next_rdt_read, gate))
    try:
        for _ in range(2):
            learner = make_policy()
            sent = hub.broadcast.remote(learner, timeout_s=8, raise_on_failure=False)
            report = ray.get(sent, timeout=60)
            assert report.acked == ("ok",), report
            assert_same(ray.get(healthy.state.remote()), state_of(learner))
    finally:
        ray.get(gate.open.remote())

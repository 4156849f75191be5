"""The ``distributed`` transport: one collective per version, groups that follow membership.

Real processes and real failures: receivers are killed with ``ray.kill`` or kept busy
in a user method, and the hub must still answer within its timeout.
"""

from __future__ import annotations

import pytest
import ray
import torch

from raysync import DistributedOptions, WeightHub, WeightReceiver
from raysync.actors.process_group import GroupStatus
from raysync.testing import special_weights
from raysync.transports.distributed import rank0_reader
from raysync.transports.object_store.bucket_stream import BROKER_NAMESPACE, broker_name
from tests.helpers import (
    Gate,
    assert_bitwise,
    assert_policy_reaches,
    free_and_reach_all,
    hold_until_opened,
    ready,
    start,
    wait_dead,
    wait_until,
)
from tests.receivers import Collector, Holder, hold_then_pull, make_policy, state_of

#: Short collective timeout: a member that never enters fails the collective fast.
_TIMEOUT_S = 4


def start_dist_hub(actors, backend: str = "gloo"):
    options = DistributedOptions(backend=backend, timeout_s=_TIMEOUT_S)
    hub = WeightHub.remote(transport="distributed", options=options)
    actors.append(hub)
    return hub


def group_status(hub) -> GroupStatus:
    actor = ray.get_actor(f"raysync-process-group-{hub.config.hub_id}")
    return ray.get(actor.describe.remote())


def test_bitwise_every_version_one_generation(actors):
    hub = start_dist_hub(actors)
    template = special_weights()
    holders = [start(actors, Holder, hub, template, f"w{i}") for i in range(3)]
    ready(holders)
    for version in range(1, 4):
        weights = special_weights(float(version))
        report = ray.get(hub.broadcast.remote(weights))
        assert report.version == version and report.acked == ("w0", "w1", "w2")
        for holder in holders:
            assert_bitwise(ray.get(holder.state.remote()), weights)
    status = group_status(hub)
    # Same members every time: one generation carried all three collectives.
    assert status.generation == 1 and status.members == ("w0", "w1", "w2")
    assert status.collectives == 3 and status.failures == ()


def test_new_receiver_joins_and_the_group_is_re_formed(actors):
    hub = start_dist_hub(actors)
    first = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(2)]
    ready(first)
    v1 = make_policy()
    ray.get(hub.broadcast.remote(v1))
    before = group_status(hub)
    assert before.members == ("c0", "c1")

    late = start(actors, Collector, hub, worker_id="late")
    # It caught up on version 1 while registering (through a group of its own).
    assert ray.get(late.version.remote()) == 1
    assert_bitwise(ray.get(late.state.remote()), state_of(v1))

    v2 = make_policy()
    report = ray.get(hub.broadcast.remote(v2))
    assert report.acked == ("c0", "c1", "late") and report.failed == {}
    after = group_status(hub)
    assert after.members == ("c0", "c1", "late")
    assert after.generation > before.generation
    for c in [*first, late]:
        assert_bitwise(ray.get(c.state.remote()), state_of(v2))


def test_rank_zero_keeps_no_generations_rendezvous_keys(actors):
    """A new generation for each set of members (here: each broadcast names another
    pair): rank 0's store kept every generation's keys for the hub's life."""
    hub = start_dist_hub(actors)
    collectors = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(3)]
    ready(collectors)
    rank0 = ray.get_actor(f"raysync-process-group-{hub.config.hub_id}")
    for pair in (["c0", "c1"], ["c1", "c2"], ["c0", "c2"], None):
        learner = make_policy()
        report = ray.get(hub.broadcast.remote(learner, workers=pair))
        assert report.acked == tuple(pair or ["c0", "c1", "c2"])
        keys = ray.get(rank0.__ray_call__.remote(lambda group: group._store.list_keys()))
        assert keys == [], keys
    assert group_status(hub).generation == 4


def test_a_member_that_pulled_the_version_meanwhile_still_enters_its_collective(actors):
    """Its delivery queued behind a method that pulled the version (the hub publishes a
    version before delivering it): it turned the delivery down without entering the
    collective, and the other members waited for it for the group's timeout (30 s by
    default), past the broadcast's, and failed."""
    options = DistributedOptions(backend="gloo", timeout_s=30)
    hub = start(actors, WeightHub, transport="distributed", options=options)
    collectors = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(3)]
    ready(collectors)
    ray.get(hub.broadcast.remote(make_policy()))
    gate, entered = start(actors, Gate), start(actors, Gate)
    pulled = collectors[2].__ray_call__.remote(hold_then_pull, gate, entered)
    ray.get(entered.wait.remote())  # the hub's delivery, made next, queues behind it
    learner = make_policy()
    report = hub.broadcast.remote(learner, timeout_s=10, raise_on_failure=False)
    wait_until(lambda: ray.get(hub.status.remote()).versions == {"policy": 2}, what="published")
    ray.get(gate.open.remote())
    assert ray.get(pulled) == {"policy": 2}
    assert ray.get(report).acked == ("c0", "c1", "c2"), ray.get(report).failed
    for collector in collectors:
        assert_bitwise(ray.get(collector.state.remote()), state_of(learner))


def test_killed_receiver_fails_and_the_next_broadcast_reaches_the_others(actors):
    hub = start_dist_hub(actors)
    survivors = [start(actors, Collector, hub, worker_id=f"ok{i}") for i in range(2)]
    victim = start(actors, Collector, hub, worker_id="victim")
    ready([*survivors, victim])
    ray.get(hub.broadcast.remote(make_policy()))
    assert group_status(hub).members == ("ok0", "ok1", "victim")

    ray.kill(victim)
    wait_dead(victim)  # else the next broadcast's call may still reach it
    # The hub does not know yet: the broadcast goes to the old group, whose collective
    # breaks. The victim is reported dead; the survivors read the learner's copy.
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner, raise_on_failure=False), timeout=60)
    assert report.acked == ("ok0", "ok1") and set(report.failed) == {"victim"}, report
    assert "died" in report.failed["victim"]
    for survivor in survivors:
        assert_bitwise(ray.get(survivor.state.remote()), state_of(learner))

    assert_policy_reaches(hub, survivors, ("ok0", "ok1"))
    status = group_status(hub)
    assert status.members == ("ok0", "ok1")


def test_a_member_dead_before_its_generation_formed_does_not_hold_up_the_others(actors):
    """The hub hears of a death from its delivery to the dead member; a generation it
    formed before that (a receiver joined) has the dead member in it, and every other
    rank waits for it at the rendezvous. The hub calls that generation off at once: the
    others read the learner's copy instead of waiting out the collective timeout
    (longer here than the broadcast's own, so waiting would fail them)."""
    options = DistributedOptions(timeout_s=120)
    hub = start(actors, WeightHub, transport="distributed", options=options)
    first, victim = (start(actors, Collector, hub, worker_id=w) for w in ("c0", "victim"))
    ready([first, victim])
    ray.get(hub.broadcast.remote(make_policy()))
    ray.kill(victim)
    late = start(actors, Collector, hub, worker_id="late")
    ready([late])

    learner = make_policy()
    report = ray.get(
        hub.broadcast.remote(learner, timeout_s=30, raise_on_failure=False), timeout=60
    )
    assert report.acked == ("c0", "late") and set(report.failed) == {"victim"}, report
    for receiver in (first, late):
        assert_bitwise(ray.get(receiver.state.remote()), state_of(learner))
    status = group_status(hub)
    assert any(
        "the hub called it off: member victim died or left" in failure
        for failure in status.failures
    ), status.failures
    assert_policy_reaches(hub, [first, late], ("c0", "late"))


def start_two_holders_and_a_busy_one(actors):
    """A gloo hub, holders h0 and h1 and a third one, "busy", all at version 1."""
    hub = start_dist_hub(actors)
    template = {"w": torch.zeros(2048, 1024)}  # 8 MB: more than a socket buffer holds
    holders = [start(actors, Holder, hub, template, f"h{i}") for i in range(2)]
    busy = start(actors, Holder, hub, template, "busy")
    ready([*holders, busy])
    ray.get(hub.broadcast.remote({"w": torch.randn(2048, 1024)}))
    return hub, holders, busy


@pytest.mark.parametrize("bucket_mb", [None, 3])  # whole, or in three buckets
def test_a_member_that_fails_versions_before_reading_them_holds_no_one_up(actors, bucket_mb):
    """A member whose model was replaced by one of another shape fails each version
    before fetching it. It still enters the version's collectives and drops what
    arrives: it fails alone, and the others' generation goes on. It used to stay out:
    each collective waited the group's timeout for it, the others read the learner's
    copy after it, and the next version formed a new generation, to fail the same way."""
    hub, holders, odd = start_two_holders_and_a_busy_one(actors)
    first = group_status(hub)
    replaced = {"w": torch.zeros(1024, 2048)}
    ray.get(odd.__ray_call__.remote(lambda self: setattr(self, "sd", replaced)))
    for _ in range(3):
        weights = {"w": torch.randn(2048, 1024)}
        ref = hub.broadcast.remote(weights, bucket_mb=bucket_mb, raise_on_failure=False)
        report = ray.get(ref, timeout=60)
        assert report.acked == ("h0", "h1") and "spec digest" in report.failed["busy"]
        for holder in holders:
            assert_bitwise(ray.get(holder.state.remote()), weights)
    status = group_status(hub)
    assert (status.generation, status.members) == (first.generation, ("busy", "h0", "h1"))
    per_version = 1 if bucket_mb is None else 3  # one per bucket of 8 MB
    assert status.collectives == first.collectives + 3 * per_version
    assert status.failures == ()


def test_member_that_never_enters_does_not_hang_the_hub(actors):
    hub, holders, busy = start_two_holders_and_a_busy_one(actors)

    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, busy, gate)  # one method at a time: no delivery gets in
    ref = hub.broadcast.remote(
        {"w": torch.randn(2048, 1024)}, timeout_s=2 * _TIMEOUT_S, raise_on_failure=False
    )
    report = ray.get(ref, timeout=60)  # the hub answers; a hang would fail here
    assert "busy" in report.failed
    # Whatever that collective left behind, the next version reaches every member.
    free_and_reach_all(hub, gate, blocked, [*holders, busy], ("busy", "h0", "h1"))


def test_a_member_busy_past_a_timeout_reads_alone_and_holds_no_one_up(actors):
    """A member busy in a long method (one call at a time: its deliveries queue behind
    it) held every other member up for the group's timeout at each version: each new
    generation took it in again and waited for it at the rendezvous. Behind (its last
    delivery timed out), it reads the learner's copy alone until it acks again, and
    the others' generation goes on without it; back, it is a member again."""
    hub, holders, busy = start_two_holders_and_a_busy_one(actors)
    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, busy, gate)  # one method at a time: no delivery gets in
    # The hub cannot know yet: this collective waits for it, the others read the copy.
    ref = hub.broadcast.remote(
        {"w": torch.randn(2048, 1024)}, timeout_s=2 * _TIMEOUT_S, raise_on_failure=False
    )
    assert set(ray.get(ref, timeout=60).failed) == {"busy"}
    for _ in range(2):  # within less than the group's timeout: no rendezvous waits for it
        weights = {"w": torch.randn(2048, 1024)}
        ref = hub.broadcast.remote(weights, timeout_s=0.75 * _TIMEOUT_S, raise_on_failure=False)
        report = ray.get(ref, timeout=60)
        assert report.acked == ("h0", "h1"), report.failed
        for holder in holders:
            assert_bitwise(ray.get(holder.state.remote()), weights)
    ray.get(gate.open.remote())
    ray.get(blocked)
    for _ in range(2):  # by the learner's copy, acked: then in the generation again
        weights = {"w": torch.randn(2048, 1024)}
        report = ray.get(hub.broadcast.remote(weights), timeout=60)
        assert report.acked == ("busy", "h0", "h1")
        for holder in [*holders, busy]:
            assert_bitwise(ray.get(holder.state.remote()), weights)
    assert group_status(hub).members == ("busy", "h0", "h1")


def test_a_busy_member_fails_alone_at_a_bucketed_version(actors):
    """Rank 0 relays a bucketed version, the bucket broker's one reader of it, one
    collective per bucket. A member busy past the group's timeout held rank 0's
    collective that long, longer than the broker waits for a reader that holds the
    stream up (half the broadcast's timeout): the broker dropped rank 0, the stream
    ended with no reader, and the healthy members found it over when they fell back
    to it: every receiver failed. Rank 0 gives a bucket's collective half that wait."""
    hub, holders, busy = start_two_holders_and_a_busy_one(actors)
    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, busy, gate)  # one method at a time: no delivery gets in
    weights = {"w": torch.randn(2048, 1024)}  # 8 MB: eight buckets
    timeout_s = 1.75 * _TIMEOUT_S  # the broker's patience, 0.875 of the group's timeout
    ref = hub.broadcast.remote(weights, bucket_mb=1, timeout_s=timeout_s, raise_on_failure=False)
    report = ray.get(ref, timeout=60)
    assert report.acked == ("h0", "h1") and set(report.failed) == {"busy"}, report.failed
    for holder in holders:
        assert_bitwise(ray.get(holder.state.remote()), weights)
    free_and_reach_all(hub, gate, blocked, [*holders, busy], ("busy", "h0", "h1"))


def test_a_busy_member_two_hops_from_rank_0_holds_no_one_up_at_the_next_versions(actors):
    """gloo broadcasts down a binomial tree: of four ranks, rank 1 ("a") passes each
    version on to rank 3 ("z"). "z" is busy past the group's timeout: rank 0 and "b"
    (its own child) finish that collective, "a" and "z" fail it and read the learner's
    copy, and the generation goes on for rank 0. At the next version rank 0's send to
    "a", which left it, fails, and rank 0 leaving closes "b"'s wait at once: every
    member reads the learner's copy within a broadcast timeout no longer than the
    group's (in four gloo ranks in threads, rank 2 waited the group's whole timeout
    there), and the version after forms a new generation."""
    hub = start_dist_hub(actors)
    template = {"w": torch.zeros(2048, 1024)}  # 8 MB: more than a socket buffer holds
    a, b, z = (start(actors, Holder, hub, template, worker) for worker in ("a", "b", "z"))
    ready([a, b, z])
    ray.get(hub.broadcast.remote({"w": torch.randn(2048, 1024)}))
    first_generation = group_status(hub).generation

    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, z, gate)  # one method at a time: no delivery gets in
    second = {"w": torch.randn(2048, 1024)}
    ref = hub.broadcast.remote(second, timeout_s=6 * _TIMEOUT_S, raise_on_failure=False)
    wait_until(
        lambda: ray.get([a.version.remote(), b.version.remote()]) == [2, 2],
        timeout_s=60,
        what="a and b hold version 2",
    )
    ray.get(gate.open.remote())
    ray.get(blocked)
    assert {"a", "b"} <= set(ray.get(ref, timeout=60).acked)

    # 3: within the group's timeout, every member reads the learner's copy; 4: a new
    # generation (its rendezvous has the default broadcast timeout).
    for version, timeout_s in ((3, _TIMEOUT_S), (4, None)):
        weights = {"w": torch.randn(2048, 1024)}
        report = ray.get(hub.broadcast.remote(weights, timeout_s=timeout_s), timeout=60)
        assert (report.version, report.acked) == (version, ("a", "b", "z")), report.failed
        for holder in (a, b, z):
            assert_bitwise(ray.get(holder.state.remote()), weights)
    assert group_status(hub).generation > first_generation


def test_a_version_in_parts_read_from_the_learners_copies_is_let_go(actors):
    """A member whose collective failed reads a version sent in parts from the learners'
    copies; once applied, it keeps none of them (each part's bytes stay pinned in the
    object store while it does)."""
    hub = start_dist_hub(actors)
    template = {"a": torch.zeros(1024, 1024), "b": torch.zeros(1024, 1024)}
    holders = [start(actors, Holder, hub, template, f"h{i}") for i in range(2)]
    busy = start(actors, Holder, hub, template, "busy")
    ready([*holders, busy])
    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, busy, gate)  # rank 1 of 4: forwards to rank 3
    weights = {"a": torch.randn(1024, 1024), "b": torch.randn(1024, 1024)}
    halves = [{"a": weights["a"]}, {"b": weights["b"]}]
    version = 1
    refs = [
        hub.broadcast.remote(
            half, version=version, part=i, parts=2, timeout_s=3 * _TIMEOUT_S, raise_on_failure=False
        )
        for i, half in enumerate(halves)
    ]
    reports = ray.get(refs, timeout=60)
    assert reports[0].acked == ("h0", "h1") and set(reports[0].failed) == {"busy"}
    for h in holders:
        assert_bitwise(ray.get(h.state.remote()), weights)
        assert ray.get(h.parts_kept.remote()) == 0
    ray.get(gate.open.remote())
    ray.get(blocked)


def test_a_plan_cut_short_while_the_last_collective_runs_still_hears_how_it_ended(actors):
    """The next plan waits for the last collective's outcome (to form a new generation
    if it failed); a broadcast whose timeout ends that wait must not lose the outcome:
    the plan after it forms a new generation instead of sending into the broken one.
    The plan waits half of its time for it (it waited all, and every target failed):
    then its targets read the learner's copy alone, and the outcome is heard later."""
    hub, holders, busy = start_two_holders_and_a_busy_one(actors)
    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, busy, gate)  # the first collective fails after its timeout
    first = hub.broadcast.remote(
        {"w": torch.randn(2048, 1024)}, timeout_s=3 * _TIMEOUT_S, raise_on_failure=False
    )
    weights = {"w": torch.randn(2048, 1024)}
    cut = hub.broadcast.remote(weights, timeout_s=1, raise_on_failure=False)
    report = ray.get(cut, timeout=60)
    assert "busy" in report.failed, report  # in its method all along
    assert {*report.failed, *report.acked} == {"busy", "h0", "h1"}, report
    for holder, worker in zip(holders, ("h0", "h1"), strict=True):
        if worker in report.acked:  # in 1 s, once out of the first collective
            assert_bitwise(ray.get(holder.state.remote()), weights)
    ray.get(first, timeout=60)
    free_and_reach_all(hub, gate, blocked, [*holders, busy], ("busy", "h0", "h1"))
    failures = group_status(hub).failures
    assert not any("broke in an earlier collective" in f for f in failures), failures


def test_pull_mode_reads_the_learner_copy(actors):
    hub = start_dist_hub(actors)
    puller = start(actors, Collector, hub, worker_id="puller", mode="pull")
    ready([puller])
    learner = make_policy()
    ray.get(hub.broadcast.remote(learner))
    assert ray.get(puller.pull.remote()) == {"policy": 1}
    assert_bitwise(ray.get(puller.state.remote()), state_of(learner))
    assert group_status(hub).generation == 0  # no collective was needed


@ray.remote(num_cpus=0, num_gpus=1)
class GpuHolder(WeightReceiver):
    def __init__(self, hub, template: dict[str, torch.Tensor]):
        self.sd = {k: torch.zeros_like(v, device="cuda") for k, v in template.items()}
        self.connect_hub(hub, models={"m": "sd"})

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in self.sd.items()}


@pytest.mark.gpu
def test_nccl_broadcast_bitwise(actors):
    if ray.cluster_resources().get("GPU", 0) < 3:
        pytest.skip("nccl needs one GPU for rank 0 and one per receiver (3 here)")
    hub = start_dist_hub(actors, backend="nccl")
    template = special_weights()
    holders = [start(actors, GpuHolder, hub, template) for _ in range(2)]
    ready(holders)
    for seed in (1.0, 2.0):
        weights = special_weights(seed)
        report = ray.get(hub.broadcast.remote(weights))
        assert report.failed == {}
        for holder in holders:
            assert_bitwise(ray.get(holder.state.remote()), weights)


def _kill_process_group_actor(hub) -> None:
    """Kill rank 0's process the way a crash would; Ray restarts the actor."""
    ray.kill(ray.get_actor(f"raysync-process-group-{hub.config.hub_id}"), no_restart=False)


def test_killed_process_group_actor_is_restarted_and_the_next_broadcast_arrives(actors):
    hub = start_dist_hub(actors)
    collectors = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(2)]
    ready(collectors)
    ray.get(hub.broadcast.remote(make_policy()))
    before = group_status(hub)

    _kill_process_group_actor(hub)
    # The hub waits for Ray to restart rank 0, sees its store listen elsewhere and forms
    # a new generation there: the next version reaches everyone.
    assert_policy_reaches(hub, collectors, ("c0", "c1"))
    after = group_status(hub)
    assert after.address != before.address
    assert after.members == ("c0", "c1") and after.collectives == 1


def test_a_hub_whose_process_group_actor_is_gone_for_good_still_closes(actors):
    hub = start_dist_hub(actors)
    collector = start(actors, Collector, hub, worker_id="c0")
    ready([collector])
    ray.get(hub.broadcast.remote(make_policy()))
    actor = ray.get_actor(f"raysync-process-group-{hub.config.hub_id}")
    ray.kill(actor, no_restart=True)
    wait_dead(actor)
    ray.get(hub.close.remote(), timeout=60)  # raised the actor's death before
    assert ray.get(hub.actor.closed.remote())


@pytest.mark.parametrize("bucket_mb", [None, 1], ids=["whole", "bucketed"])
def test_process_group_actor_killed_mid_collective_loses_no_version(actors, bucket_mb):
    """Bucketed, rank 0 is the stream's one reader, killed as it relays: the members
    read the rest from the bucket broker (a member still busy past the broker's stall
    time fails alone, as at any bucketed version)."""
    hub, holders, busy = start_two_holders_and_a_busy_one(actors)

    # "busy" keeps the collective from completing while rank 0 dies. Whenever the kill
    # lands, the members read the learner's object-store copy (or the broker's buckets)
    # instead: nobody else fails.
    gate = start(actors, Gate)
    blocked = hold_until_opened(actors, busy, gate)
    weights = {"w": torch.randn(2048, 1024)}
    ref = hub.broadcast.remote(
        weights, timeout_s=3 * _TIMEOUT_S, raise_on_failure=False, bucket_mb=bucket_mb
    )
    if bucket_mb is not None:  # killed as it relays: it took bucket 0, asked for the next
        broker = ray.get_actor(broker_name(hub.config.hub_id), namespace=BROKER_NAMESPACE)
        reader = rank0_reader(hub.config.hub_id)
        wait_until(
            lambda: ray.get(broker.taken.remote(reader)) >= 1, what="rank 0 relays bucket 0"
        )
    _kill_process_group_actor(hub)
    ray.get(gate.open.remote())
    report = ray.get(ref, timeout=60)
    ray.get(blocked)
    reached = [*holders, busy]
    if bucket_mb is None:
        assert report.acked == ("busy", "h0", "h1") and report.failed == {}, report
    else:
        assert {"h0", "h1"} <= set(report.acked), report.failed
        if "busy" in report.failed:  # still joining rank 0's dead store as the others read
            assert "had not taken bucket" in report.failed["busy"], report.failed
            reached = holders
    for h in reached:
        assert_bitwise(ray.get(h.state.remote()), weights)

    weights = {"w": torch.randn(2048, 1024)}
    report = ray.get(hub.broadcast.remote(weights), timeout=60)
    assert report.acked == ("busy", "h0", "h1") and report.failed == {}
    for h in [*holders, busy]:
        assert_bitwise(ray.get(h.state.remote()), weights)

"""Core behaviour against a real Ray cluster: delivery, versions, receivers, failures.

What every transport must do (bitwise delivery of every dtype, late join, pull, buffer
reuse, a dead receiver, zero copy, release) is the conformance kit's, run per transport
in test_conformance.py (whose tests all broadcast to subsets of a hub's receivers).
Tests here of the hub's, the receiver's or the learner's own logic (numbering, status,
targets, deadlines, reports, hooks, spec checks, the API's forms, flattening) run on
the default transport only; those where a transport keeps state per model or per
receiver (several models, in-place applies and superseded versions on a shared hub)
run on every transport."""

from __future__ import annotations

import re
import threading
import time

import pytest
import ray
import torch
from tensordict import TensorDict

import raysync
from raysync import (
    BroadcastError,
    BroadcastReport,
    BroadcastTicket,
    DeliveryMode,
    HubClosedError,
    SpecMismatchError,
    StaleVersionError,
    WeightHub,
    get_hub,
)
from raysync.messages import Entry
from raysync.receiver_delivery import delivery_call
from raysync.testing import assert_bitwise, special_weights
from raysync.transports import DEFAULT_TRANSPORT, TransportError, register_transport
from tests.helpers import (
    Gate,
    assert_same,
    hold_the_actor,
    hold_until_opened,
    keep_two_reports,
    ready,
    start,
    start_hub,
    wait_dead,
    wait_until,
)
from tests.receivers import (
    BeatCountingHolder,
    Collector,
    Decorated,
    FailingHook,
    Holder,
    MultiModel,
    SlowHook,
    make_policy,
    state_of,
)
from tests.third_party_transport import (
    HangingJoinTransport,
    HeldJoinTransport,
    LostCopyTransport,
    NoReopenTransport,
    SlowLeaveTransport,
    joins_waiting,
    let_joins_go,
    planner_events,
    token_of,
)


def _assert_phases_cover_every_receiver(report: BroadcastReport) -> None:
    """Where the time went: one learner and one planning figure, each receiver phase
    spread over every receiver that applied, each within the broadcast's seconds."""
    phases = report.phases
    assert phases is not None and 0 < phases.learner_s < report.seconds
    assert 0 <= phases.plan_s < report.seconds
    for spread in (phases.deliver_s, phases.fetch_s, phases.wait_s, phases.apply_s):
        assert spread is not None and spread.count == len(report.acked), phases
        assert 0 <= spread.p50 <= spread.max < report.seconds, phases
    assert phases.fetch_s.max <= phases.deliver_s.max, phases


class TestBroadcast:
    @pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # hub logic
    def test_readme_example_bitwise_every_version(self, actors, transport):
        hub = start_hub(actors, transport)
        collectors = [start(actors, Collector, hub) for _ in range(4)]
        ready(collectors)
        learner = make_policy()
        for step in range(1, 4):
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(torch.randn_like(p))
            report = ray.get(hub.broadcast.remote(learner))
            assert isinstance(report, BroadcastReport)
            assert report.version == step
            assert report.model == "policy"
            assert len(report.acked) == 4 and report.failed == {}
            assert report.bytes == sum(t.numel() * 4 for t in learner.state_dict().values())
            assert report.seconds > 0
            _assert_phases_cover_every_receiver(report)
            for c in collectors:
                assert_same(ray.get(c.state.remote()), state_of(learner))
                assert ray.get(c.version.remote()) == step

    # These tests use the session's hub and receiver of their transport (they kill
    # nothing), so they check versions relative to the one they find.
    @pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # the learner flattens
    def test_accepts_module_tensordict_and_state_dict(self, shared_hubs, transport):
        """Each form holds weights of its own (a fresh policy each), so what arrives
        after each broadcast is that form's data, not what the one before delivered."""
        hub, collector = shared_hubs.pair(transport)
        module, in_tensordict, in_dict = make_policy(), make_policy(), make_policy()
        inputs = [
            (module, state_of(module)),
            (TensorDict.from_module(in_tensordict), state_of(in_tensordict)),
            (state_of(in_dict), state_of(in_dict)),
        ]
        for weights, expected in inputs:
            version = ray.get(hub.broadcast.remote(weights)).version
            assert_same(ray.get(collector.state.remote()), expected)
            assert ray.get(collector.version.remote()) == version

    def test_applies_in_place_without_reallocating(self, shared_hubs, transport):
        hub, collector = shared_hubs.pair(transport)
        before = ray.get(collector.data_ptrs.remote())
        for _ in range(2):
            ray.get(hub.broadcast.remote(make_policy()))
        assert ray.get(collector.data_ptrs.remote()) == before

    @pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # the receiver checks its spec
    def test_model_changed_after_connect(self, actors, transport):
        """Receivers reuse their write targets while the module's tensors stay put: a
        parameter replaced after connect_hub still gets the update, and a model whose
        spec changed fails that worker with both digests, not a silent no-op."""
        hub = start_hub(actors, transport)
        replaced, retyped = (
            start(actors, Collector, hub, "replaced"),
            start(actors, Collector, hub, "retyped"),
        )
        ready([replaced, retyped])
        ray.get(hub.broadcast.remote(make_policy()))
        new_parameter = torch.nn.Parameter(torch.zeros(64, 8))  # new storage
        ray.get(
            replaced.__ray_call__.remote(
                lambda self: setattr(self.policy[0], "weight", new_parameter)
            )
        )
        ray.get(retyped.__ray_call__.remote(lambda self: self.policy.double()))
        learner = make_policy()
        report = ray.get(hub.broadcast.remote(learner, raise_on_failure=False))
        assert report.acked == ("replaced",)
        assert_same(ray.get(replaced.state.remote()), state_of(learner))
        assert "spec digest" in report.failed["retyped"]
        assert "float64" in report.failed["retyped"]

    @pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # hub logic
    def test_version_increases_per_model_and_status_reports_lag(self, actors, transport):
        hub = start_hub(actors, transport)
        push = start(actors, Collector, hub, worker_id="push")
        pull = start(actors, Collector, hub, worker_id="pull", mode="pull")
        ready([push, pull])
        started = time.time()  # the hub's clock is this machine's
        versions = [ray.get(hub.broadcast.remote(make_policy())).version for _ in range(3)]
        assert versions == [1, 2, 3]
        status = ray.get(hub.status.remote())
        asked = time.time()
        assert status.versions == {"policy": 3}
        by_worker = {r.worker: r for r in status.receivers}
        assert by_worker["push"].versions == {"policy": 3} and by_worker["push"].lag == {
            "policy": 0
        }
        assert by_worker["pull"].mode is DeliveryMode.PULL
        assert by_worker["pull"].lag == {"policy": 3}
        # In seconds too: since version 1 was published; and the push receiver's timings
        # of the last version it applied.
        assert by_worker["push"].lag_s == {"policy": 0.0}
        assert 0 < by_worker["pull"].lag_s["policy"] <= asked - started
        timings = by_worker["push"].last_timings["policy"]
        assert min(timings.fetch_s, timings.wait_s, timings.apply_s) >= 0
        assert by_worker["pull"].last_timings == {}


class TestReceivers:
    @pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # hub logic
    def test_broadcast_before_any_receiver_registers(self, actors, transport):
        hub = start_hub(actors, transport, models=("policy",))  # declared: the learner is first
        learner = make_policy()
        ray.get(hub.broadcast.remote(learner, model="policy"))
        late = start(actors, Collector, hub)
        assert ray.get(late.version.remote()) == 1
        assert_same(ray.get(late.state.remote()), state_of(learner))

    def test_a_late_joiner_whose_catch_up_cannot_be_planned_starts_and_gets_the_next(self, actors):
        """Its transport cannot plan the read of the latest version (its copy is gone):
        the receiver still registers (its actor starts), behind, and the next broadcast
        reaches it."""
        register_transport("lost_copy", LostCopyTransport)
        hub = start_hub(actors, "lost_copy")
        early = start(actors, Collector, hub, worker_id="early")
        ready([early])
        ray.get(hub.broadcast.remote(make_policy()))
        late = start(actors, Collector, hub, worker_id="late")
        assert ray.get(late.version.remote()) == 0
        learner = make_policy()
        report = ray.get(hub.broadcast.remote(learner))
        assert (report.version, report.acked) == (2, ("early", "late"))
        assert_same(ray.get(late.state.remote()), state_of(learner))

    @pytest.mark.parametrize(
        "transport", [DEFAULT_TRANSPORT]
    )  # the hub targets; the kit's tests all target subsets
    def test_subset_broadcast_leaves_others_alone(self, actors, transport):
        hub = start_hub(actors, transport)
        a = start(actors, Collector, hub, worker_id="a")
        b = start(actors, Collector, hub, worker_id="b")
        ready([a, b])
        v1 = make_policy()
        ray.get(hub.broadcast.remote(v1))
        v2 = make_policy()
        report = ray.get(hub.broadcast.remote(v2, workers=["b"]))
        assert report.acked == ("b",)
        assert_same(ray.get(a.state.remote()), state_of(v1))
        assert_same(ray.get(b.state.remote()), state_of(v2))
        assert ray.get(a.version.remote()) == 1 and ray.get(b.version.remote()) == 2

    @pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # hub logic
    def test_pull_mode(self, actors, transport):
        hub = start_hub(actors, transport)
        puller = start(actors, Collector, hub, worker_id="puller", mode="pull")
        ready([puller])
        learner = make_policy()
        report = ray.get(hub.broadcast.remote(learner))
        assert report.acked == ()  # pull receivers are not pushed to
        assert ray.get(puller.version.remote()) == 0
        assert ray.get(puller.pull.remote()) == {"policy": 1}
        assert_same(ray.get(puller.state.remote()), state_of(learner))
        assert ray.get(puller.pull.remote()) == {"policy": 1}  # nothing newer: no-op
        lag = {r.worker: r.lag for r in ray.get(hub.status.remote()).receivers}
        assert lag["puller"] == {"policy": 0}

    def test_the_hub_forgets_a_pull_receiver_whose_heartbeats_stopped(self, actors):
        """Nobody calls a pull receiver: its death shows only as heartbeats that stop.
        Both registered together; only the one that keeps beating stays."""
        hub = start_hub(actors, DEFAULT_TRANSPORT)
        beat = 0.5
        dies, lives = (
            start(actors, Collector, hub, worker_id=w, mode="pull", heartbeat_s=beat)
            for w in ("dies", "lives")
        )
        ready([dies, lives])
        ray.kill(dies, no_restart=True)
        deadline = time.monotonic() + 60
        while "dies" in (workers := {r.worker for r in ray.get(hub.status.remote()).receivers}):
            assert time.monotonic() < deadline, "the dead pull receiver was never forgotten"
            time.sleep(beat / 5)  # polling the hub's status: nothing to wait on
        assert workers == {"lives"}
        learner = make_policy()
        ray.get(hub.broadcast.remote(learner))
        assert ray.get(lives.pull.remote()) == {"policy": 1}
        assert_same(ray.get(lives.state.remote()), state_of(learner))

    def test_multi_model_and_model_paths(self, actors, transport):
        hub = start_hub(actors, transport)
        multi = start(actors, MultiModel, hub)
        ready([multi])
        norm = torch.nn.BatchNorm1d(8)
        with torch.no_grad():
            norm.running_mean.add_(3.0)
            norm.weight.mul_(2.0)
        norm.num_batches_tracked += 5
        updates = {
            "policy": make_policy(),
            "critic": torch.nn.Linear(8, 1),
            "obs_norm": norm,
            "td": TensorDict({"a": torch.ones(3), "b": {"c": torch.full((2, 2), 7.0)}}, []),
            "sd": {"w": torch.arange(4.0), "b": torch.tensor([9.0])},
        }
        for model, weights in updates.items():
            report = ray.get(hub.broadcast.remote(weights, model=model))
            assert report.model == model and report.version == 1
        assert_same(ray.get(multi.state.remote("policy")), state_of(updates["policy"]))
        assert_same(ray.get(multi.state.remote("nets.critic")), state_of(updates["critic"]))
        assert_same(ray.get(multi.norm_state.remote()), state_of(norm))
        assert_same(
            ray.get(multi.state.remote("td")), dict(updates["td"].flatten_keys(".").items())
        )
        assert_same(ray.get(multi.state.remote("sd")), updates["sd"])
        assert ray.get(hub.status.remote()).versions == {m: 1 for m in sorted(updates)}

    @pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # hub logic
    def test_decorator_form_and_named_hub(self, actors, transport):
        hub = start_hub(actors, transport, {"name": "raysync-test-hub"})
        receiver = start(actors, Decorated, "raysync-test-hub")
        ready([receiver])
        learner = make_policy()
        same_hub = get_hub("raysync-test-hub")
        ray.get(same_hub.broadcast.remote(learner))
        assert_same(ray.get(receiver.state.remote()), state_of(learner))
        assert ray.get(hub.status.remote()).versions == {"default": 1}

    @pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # hub logic
    def test_get_if_exists_hands_back_the_running_hub_with_its_own_settings(
        self, actors, transport, caplog
    ):
        """Ray hands back the running hub and ignores the arguments: the handle was
        built from them (another hub_id, which names the hub's resource actors, another
        transport), and a learner looked for actors that did not exist."""
        hub = start_hub(actors, transport, {"name": "raysync-existing-hub"})
        receiver = start(actors, Decorated, "raysync-existing-hub")
        ready([receiver])
        again = WeightHub.options(name="raysync-existing-hub", get_if_exists=True).remote(
            transport="shared_memory", timeout_s=7
        )
        assert again.config == hub.config
        assert "transport='object_store' (asked: 'shared_memory')" in caplog.text
        assert "default_timeout_s=60.0 (asked: 7)" in caplog.text
        learner = make_policy()
        report = ray.get(again.broadcast.remote(learner))
        assert (report.version, len(report.acked), report.failed) == (1, 1, {})
        assert_same(ray.get(receiver.state.remote()), state_of(learner))
        # None of that name yet: started as asked, without waiting for it (the ack
        # timeout is no bound on an actor's start).
        fresh = WeightHub.options(name="raysync-fresh-hub", get_if_exists=True).remote(
            timeout_s=0.001
        )
        actors.append(fresh)
        assert ray.get(fresh.actor.config.remote()) == fresh.config

    @pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # hub logic
    def test_get_if_exists_that_loses_the_race_to_start_the_hub_takes_the_winners_settings(
        self, actors, transport, monkeypatch
    ):
        """Two processes start the same named hub at once: both find none running, the
        other creates it first. Ray's get_if_exists then handed this one the other's
        actor, and the handle carried this call's settings (its own hub_id, which names
        the hub's resource actors: a shared-memory learner looked for an owner that
        never existed)."""
        from raysync import hub_launch

        hub = start_hub(actors, transport, {"name": "raysync-raced-hub"})
        found = hub_launch.HubLauncher._running
        looks: list[object] = []

        def running(self):  # the first look came before the other process created it
            looks.append(self)
            return None if len(looks) == 1 else found(self)

        monkeypatch.setattr(hub_launch.HubLauncher, "_running", running)
        again = WeightHub.options(name="raysync-raced-hub", get_if_exists=True).remote(
            transport="shared_memory"
        )
        assert again.config == hub.config
        assert again.actor._actor_id == hub.actor._actor_id

    def test_stale_and_duplicate_updates_are_skipped(self, shared_hubs, transport):
        hub, collector = shared_hubs.pair(transport)
        first = ray.get(hub.broadcast.remote(make_policy())).version
        old = ray.get(hub.latest.remote("policy"))
        newest = make_policy()
        ray.get(hub.broadcast.remote(newest))
        # Re-deliver the older version (stale) and the current one (duplicate) by hand,
        # the way the hub delivers.
        key = ray.get(
            collector.__ray_call__.remote(lambda c: c._raysync_receiver.core.identity.attachment)
        )
        stale = ray.get(delivery_call(collector, Entry.MIXIN_METHOD, key, old))
        latest = ray.get(hub.latest.remote("policy"))
        duplicate = ray.get(delivery_call(collector, Entry.MIXIN_METHOD, key, latest))
        assert stale.status.value == "superseded" and duplicate.status.value == "superseded"
        assert ray.get(collector.version.remote()) == first + 1
        assert_same(ray.get(collector.state.remote()), state_of(newest))
        applied = ray.get(collector.applied_versions.remote())
        assert applied[-2:] == [("policy", first), ("policy", first + 1)]


class TestAsyncAcks:
    @pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # hub logic
    def test_fire_and_forget_then_wait_for(self, shared_hubs, transport):
        hub, collector = shared_hubs.pair(transport)
        start = ray.get(hub.status.remote()).versions.get("policy", 0)
        tickets = [ray.get(hub.broadcast.remote(make_policy(), wait=False)) for _ in range(3)]
        versions = [start + 1, start + 2, start + 3]
        assert tickets == [BroadcastTicket("policy", v) for v in versions]
        reports = ray.get([hub.wait_for.remote(t) for t in tickets])
        assert [r.version for r in reports] == versions
        assert all(r.acked == ("w0",) for r in reports)
        assert ray.get(collector.version.remote()) == versions[-1]


def test_broadcasts_still_running_past_the_reports_kept_can_be_waited_for(actors):
    """The hub keeps the reports of its last broadcasts for ``wait_for`` (two here):
    those still running, behind a receiver busy in a long method, are kept however
    many (the oldest were let go, and ``wait_for`` raised for a running broadcast)."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    ray.get(hub.actor.__ray_call__.remote(keep_two_reports))
    template = special_weights(0.0)
    holder = start(actors, Holder, hub, template, "busy")
    ready([holder])
    gate = start(actors, Gate)
    busy = hold_until_opened(actors, holder, gate)
    weights = [special_weights(float(v)) for v in range(1, 5)]
    tickets = ray.get([hub.broadcast.remote(w, model="m", wait=False) for w in weights])
    waiting = [hub.wait_for.remote(t) for t in tickets]
    gate.open.remote()
    ray.get(busy)
    reports = ray.get(waiting, timeout=60)
    assert [r.version for r in reports] == [t.version for t in tickets]
    assert all(r.failed == {} and r.acked == ("busy",) for r in reports)
    assert_bitwise(ray.get(holder.state.remote()), weights[-1])


def test_a_receiver_busy_in_a_long_method_is_sent_the_newest_version_not_each_one(actors):
    """A default actor runs one call at a time: busy in a long method, it queued one
    delivery call per version broadcast meanwhile (each holding its version's payload
    in the object store until it ran) and then applied every one of them in turn. The
    learner calls it while at most two of its calls run; the hub's deliveries of the
    later versions wait for those to return, and the newest of them goes alone. Every
    version is acked (the receiver holds a newer one, as a superseded version acks)."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    holder = start(actors, Holder, hub, special_weights(0.0), "busy")
    ready([holder])
    first = special_weights(1.0)
    ray.get(hub.broadcast.remote(first, model="m"))  # its route comes back with it
    gate = start(actors, Gate)
    busy = hold_until_opened(actors, holder, gate)
    weights = [special_weights(float(v)) for v in range(2, 7)]
    tickets = ray.get([hub.broadcast.remote(w, model="m", wait=False) for w in weights])
    assert [t.version for t in tickets] == [2, 3, 4, 5, 6]
    waiting = [hub.wait_for.remote(t) for t in tickets]
    ray.get(gate.open.remote())
    ray.get(busy)
    reports = ray.get(waiting, timeout=60)
    assert [r.direct for r in reports] == [("busy",), ("busy",), (), (), ()]
    assert all(r.failed == {} and r.acked == ("busy",) for r in reports)
    assert ray.get(holder.applied_versions.remote()) == [1, 2, 3, 6]
    assert_bitwise(ray.get(holder.state.remote()), weights[-1])


def test_a_receiver_busy_past_its_timeouts_gets_no_call_per_version_and_then_the_latest(
    actors,
):
    """Deliveries to a receiver busy past their timeout: the first one's call waits
    behind the method; the later ones made a call each too, each holding its version's
    payload in the object store until the method ended, then applied in turn. They
    make none now and fail saying why; once the first call returns, the hub sends the
    receiver the latest version (outside any broadcast, as a pull reads it)."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    holder = start(actors, Holder, hub, special_weights(0.0), "busy")
    ready([holder])
    ray.get(hub.broadcast.remote(special_weights(1.0), model="m"))
    gate = start(actors, Gate)
    busy = hold_until_opened(actors, holder, gate)
    weights = {v: special_weights(float(v)) for v in (2, 3, 4)}
    reports = [  # a version named: the hub delivers it (no direct path)
        ray.get(
            hub.broadcast.remote(w, model="m", version=v, timeout_s=1.0, raise_on_failure=False)
        )
        for v, w in weights.items()
    ]
    assert [(r.version, set(r.failed)) for r in reports] == [(v, {"busy"}) for v in weights]
    assert reports[0].failed["busy"].endswith("within the 1 s timeout")
    for report in reports[1:]:
        assert report.failed["busy"].endswith(
            "within the 1 s timeout (the hub makes one delivery call to it at a time, and "
            "the call that delivered version 2 to it had not returned)"
        )
    ray.get(gate.open.remote())
    ray.get(busy)
    wait_until(
        lambda: ray.get(holder.version.remote()) == 4, what="the busy receiver holds version 4"
    )
    assert ray.get(holder.applied_versions.remote()) == [1, 2, 4]
    assert_bitwise(ray.get(holder.state.remote()), weights[4])
    wait_until(
        lambda: ray.get(hub.status.remote()).receivers[0].versions == {"m": 4},
        what="the hub's books say it holds version 4",
    )


def test_a_receiver_free_again_during_a_broadcast_to_others_catches_up_after_it(actors):
    """A receiver busy past its timeout is free again while the latest version's
    broadcast, to another receiver only, still runs: the hub left its catch-up to that
    broadcast, which does not target it, and it stayed behind until the next one."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    template = state_of(make_policy())
    late, other = (start(actors, Holder, hub, template, w) for w in ("late", "other"))
    ready([late, other])
    ray.get(hub.broadcast.remote(template, model="m"))
    late_gate, late_in, other_gate, other_in = (start(actors, Gate) for _ in range(4))
    late_busy = late.hold.remote(late_gate, late_in)
    ray.get(late_in.wait.remote())
    sent = hub.broadcast.remote(template, model="m", timeout_s=3.0, raise_on_failure=False)
    assert set(ray.get(sent, timeout=60).failed) == {"late"}  # version 2: timed out
    other_busy = other.hold.remote(other_gate, other_in)
    ray.get(other_in.wait.remote())
    latest = state_of(make_policy())
    running = hub.broadcast.remote(latest, model="m", workers=["other"], timeout_s=120)
    wait_until(
        lambda: ray.get(hub.status.remote()).versions == {"m": 3},
        what="version 3 is the hub's latest",
    )
    ray.get(late_gate.open.remote())  # version 2 applied: free while version 3 runs
    ray.get(late_busy)
    wait_until(
        lambda: {r.worker: r.versions for r in ray.get(hub.status.remote()).receivers}["late"]
        == {"m": 2},
        what="late holds version 2",
    )
    ray.get(other_gate.open.remote())
    ray.get(other_busy)
    assert ray.get(running, timeout=60).acked == ("other",)
    wait_until(lambda: ray.get(late.version.remote()) == 3, what="late catches up with 3")
    assert_same(ray.get(late.state.remote()), latest)


def test_a_host_busy_for_many_hub_watch_beats_gets_one_catch_up_call(actors):
    """The hub forgot a receiver (as after a restart) while its host is busy in a long
    method: its hub watch registers again and delivers the version the hub offers
    through the host, which does not answer within the call's timeout. Each later beat
    made one more call behind the method, each pinning its version's payload until the
    method ended (a rollout of minutes: a call every heartbeat). The call queued first
    is waited for instead; once it answered, the receiver is up to date."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    holder = start(actors, BeatCountingHolder, hub, special_weights(0.0), "busy", 0.2)
    other = start(actors, Holder, hub, special_weights(0.0), "other")
    ready([holder, other])
    ray.get(hub.broadcast.remote(special_weights(1.0), model="m"))
    offered = special_weights(2.0)  # the latest, which "busy" lacks
    assert ray.get(hub.broadcast.remote(offered, model="m", workers=["other"])).version == 2
    token, before = ray.get([holder.token.remote(), holder.deliveries_so_far.remote()])
    gate = start(actors, Gate)
    busy = hold_until_opened(actors, holder, gate)
    ray.get(hub.actor.leave.remote("busy", token))  # the hub forgets it; its watch registers again
    beats = ray.get(holder.beats_so_far.remote())
    wait_until(  # each made a call behind the method (the first waits its 5 s timeout)
        lambda: ray.get(holder.beats_so_far.remote()) >= beats + 6,
        timeout_s=60,
        what="six hub-watch beats while the host is busy",
    )
    ray.get(gate.open.remote())
    ray.get(busy)
    assert ray.get(holder.deliveries_so_far.remote()) - before == 1
    assert_bitwise(ray.get(holder.state.remote()), offered)
    wait_until(
        lambda: (
            {r.worker: r.versions for r in ray.get(hub.status.remote()).receivers}
            == {"busy": {"m": 2}, "other": {"m": 2}}
        ),
        what="the hub's books say it holds version 2",
    )
    weights = special_weights(3.0)
    assert ray.get(hub.broadcast.remote(weights, model="m")).acked == ("busy", "other")
    assert_bitwise(ray.get(holder.state.remote()), weights)


def test_a_re_registration_whose_transport_cannot_open_takes_itself_back(actors):
    """The hub forgot a receiver; its hub watch registers again, and the new transport
    receiver cannot open: the receiver keeps its old token and tries again at the next
    beats. The hub kept each new registration all the same, one nobody here holds
    (broadcasts targeted it, ``hub.status`` listed it) until a later one replaced it.
    The receiver now takes each one back: its transport's planner is told it left."""
    register_transport("no_reopen", NoReopenTransport)
    hub = start_hub(actors, "no_reopen")
    holder = start(actors, Holder, hub, special_weights(0.0), "w", heartbeat_s=0.2)
    ready([holder])
    ray.get(hub.broadcast.remote(special_weights(1.0), model="m"))
    token = ray.get(holder.__ray_call__.remote(lambda self: self._raysync_receiver.core.token))
    ray.get(hub.actor.leave.remote("w", token))  # the hub forgets it; its watch registers again
    wait_until(
        lambda: (
            "cannot open again"
            in str(ray.get(holder.__ray_call__.remote(lambda s: s.weights_connection().last_error)))
        ),
        what="a re-registration that failed to open its transport",
    )
    events = lambda: ray.get(hub.actor.__ray_call__.remote(planner_events, "no_reopen"))  # noqa: E731
    wait_until(
        lambda: events()[:4] == [("joined", "w"), ("left", "w"), ("joined", "w"), ("left", "w")],
        what="the failed re-registration taken back",
    )


class TestFailures:
    @pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # hub logic
    def test_receiver_error_travels_back_with_traceback(self, actors, transport):
        hub = start_hub(actors, transport)
        good = start(actors, Collector, hub, worker_id="good")
        bad = start(actors, FailingHook, hub)
        ready([good, bad])
        ray.get(hub.broadcast.remote(make_policy()))
        with pytest.raises(BroadcastError) as info:
            ray.get(hub.broadcast.remote(make_policy()))
        report = info.value.report
        assert report.acked == ("good",)
        ((_, reason),) = report.failed.items()
        assert "hook refuses version 2" in reason and "Traceback" in reason
        assert "FailingHook" in reason
        assert "FailingHook" in str(info.value)

    @pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # hub logic
    def test_report_instead_of_raise(self, actors, transport):
        hub = start_hub(actors, transport)
        bad = start(actors, FailingHook, hub)
        ready([bad])
        ray.get(hub.broadcast.remote(make_policy()))
        report = ray.get(hub.broadcast.remote(make_policy(), raise_on_failure=False))
        assert report.acked == () and len(report.failed) == 1 and not report.ok

    @pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # the hub's deadline
    def test_slow_receiver_times_out_without_delaying_others(self, actors, transport):
        hub = start_hub(actors, transport)
        fast = start(actors, Collector, hub, worker_id="fast")
        slow = start(actors, SlowHook, hub, 5.0)
        ready([fast, slow])
        ray.get(hub.broadcast.remote(make_policy()))
        report = ray.get(hub.broadcast.remote(make_policy(), timeout_s=3.0, raise_on_failure=False))
        assert report.acked == ("fast",)
        (reason,) = report.failed.values()
        assert "within the 3 s timeout" in reason and "SlowHook" in reason
        assert ray.get(fast.version.remote()) == 2


def test_a_broadcast_to_a_hub_that_does_not_answer_fails_within_its_timeout(actors):
    """A learner's first broadcast asks the hub which hand-offs it takes: a hub alive
    but hung (here held by a call) kept ``broadcast.remote`` blocked for ever. It fails
    within the broadcast's timeout, nothing sent; the hub, free again, goes on."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    collector = start(actors, Collector, hub, worker_id="c")
    ready([collector])
    gate, entered = start(actors, Gate), start(actors, Gate)
    held = hub.actor.__ray_call__.remote(hold_the_actor, gate, entered)
    ray.get(entered.wait.remote())  # hung before the broadcast asks it anything
    try:
        with pytest.raises(TimeoutError, match="did not answer within 2 s"):
            hub.broadcast.remote(make_policy(), timeout_s=2)
    finally:
        ray.get(gate.open.remote())
        ray.get(held)
    learner = make_policy()
    assert ray.get(hub.broadcast.remote(learner)).version == 1
    assert_same(ray.get(collector.state.remote()), state_of(learner))


def test_get_hub_of_a_hub_that_does_not_answer_names_it(actors):
    """Found by name, the hub is busy (hung here): Ray's bare GetTimeoutError named no hub."""
    hub = start_hub(actors, DEFAULT_TRANSPORT, {"name": "raysync-busy-hub"})
    gate, entered = start(actors, Gate), start(actors, Gate)
    held = hub.actor.__ray_call__.remote(hold_the_actor, gate, entered)
    ray.get(entered.wait.remote())
    try:
        with pytest.raises(TimeoutError, match="hub 'raysync-busy-hub' .* did not answer"):
            get_hub("raysync-busy-hub", timeout_s=1)
    finally:
        ray.get(gate.open.remote())
        ray.get(held)
    assert get_hub("raysync-busy-hub").config == hub.config


def test_a_registration_whose_answer_timed_out_stays_nobodys(actors):
    """A receiver whose ``register`` call the hub (busy, here held) did not answer in
    time raises, and holds no registration; the hub took the call in later all the
    same, and every broadcast then targeted, and failed on, a receiver nobody held
    (until that worker id registered again). The call is withdrawn, and the next
    broadcast reaches the others."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    collector = start(actors, Collector, hub, worker_id="c")
    ready([collector])
    ray.get(hub.broadcast.remote(make_policy()))
    # A refusal the hub keeps until this worker id gets in: its registration's trace.
    with pytest.raises(SpecMismatchError):
        raysync.attach(hub, {"policy": special_weights(0.0)}, worker_id="gave-up", mode="pull")
    gate, entered = start(actors, Gate), start(actors, Gate)
    held = hub.actor.__ray_call__.remote(hold_the_actor, gate, entered)
    ray.get(entered.wait.remote())
    try:
        with pytest.raises(ray.exceptions.GetTimeoutError):
            raysync.attach(
                hub, {"policy": make_policy()}, worker_id="gave-up", mode="pull", timeout_s=1
            )
    finally:
        ray.get(gate.open.remote())
        ray.get(held)

    def settled():
        """The registration taken in (the spec refusal gone) and withdrawn, or refused."""
        status = ray.get(hub.status.remote())
        refusal = status.refused.get("gave-up")
        registered = [r.worker for r in status.receivers]
        if "SpecMismatchError" in getattr(refusal, "error", "") or "gave-up" in registered:
            return None
        return registered, refusal

    registered, refusal = wait_until(settled, what="the registration given up withdrawn")
    assert registered == ["c"]
    if refusal is not None:  # withdrawn before it was taken in, or while it was
        assert re.search("withdrew this registration|dropped while it registered", refusal.error)
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner, timeout_s=30))
    assert report.acked == ("c",) and not report.failed
    assert_same(ray.get(collector.state.remote()), state_of(learner))


def _sent_late(hub, gate, weights: dict, model: str):
    """Broadcast ``weights`` from this learner with its call held back until the call
    returned is made (its number taken now and in flight meanwhile, as a call still on
    its way): the learner's next broadcasts reach the hub first."""
    side = hub._side
    submit, held_back = side.submit, []

    def submit_later(send):
        with side.submitting:
            sequence = side.next_sequence
            side.next_sequence += 1
            placeholder = gate.wait.remote()  # what the learner's handle waits on meanwhile
            side.in_flight.add(sequence, placeholder)
        held_back.append(lambda: send(sequence, side.in_flight.floor(sequence)))
        return sequence, placeholder

    side.submit = submit_later
    try:
        hub.broadcast.remote(weights, model=model)
    finally:
        side.submit = submit
    return held_back[0]


def test_a_broadcast_reaching_the_hub_after_the_learners_next_one_is_refused_as_stale(actors):
    """A learner's broadcast whose call reaches the hub after its next one (same model)
    was versioned without it (the hub waits a second for a missing number): published
    then, its older weights replaced the newer ones on every receiver and for every late
    joiner, and both reports said OK. It is refused, naming it; the newer weights stay."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    holder = start(actors, Holder, hub, special_weights(0.0), "w")
    gate = start(actors, Gate)
    ready([holder])
    ray.get(hub.broadcast.remote(special_weights(1.0), model="m"))
    older, newer = special_weights(2.0), special_weights(3.0)
    send_late = _sent_late(hub, gate, older, "m")
    report = ray.get(hub.broadcast.remote(newer, model="m"), timeout=60)
    assert report.acked == ("w",)
    late = send_late()
    ray.get(gate.open.remote())
    with pytest.raises(StaleVersionError, match=r"broadcast \d+ of learner .* not published"):
        ray.get(late, timeout=60)
    assert ray.get(hub.status.remote()).versions == {"m": report.version}
    assert ray.get(holder.version.remote()) == report.version
    assert_bitwise(ray.get(holder.state.remote()), newer)


def test_a_late_broadcast_of_a_model_no_later_one_replaced_is_published(actors):
    """The learner's numbers run across its models: a late call of model a, after a
    call of model b went on without it, holds no older weights than any published."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    a = start(actors, Holder, hub, special_weights(0.0), "a", "a")
    b = start(actors, Holder, hub, special_weights(0.0), "b", "b")
    gate = start(actors, Gate)
    ready([a, b])
    send_late = _sent_late(hub, gate, special_weights(1.0), "a")
    ray.get(hub.broadcast.remote(special_weights(2.0), model="b"), timeout=60)
    late = send_late()
    ray.get(gate.open.remote())
    report = ray.get(late, timeout=60)
    assert report.acked == ("a",)
    assert ray.get(hub.status.remote()).versions["a"] == report.version
    assert_bitwise(ray.get(a.state.remote()), special_weights(1.0))


def test_a_receiver_that_leaves_and_attaches_again_at_once_joins_after_it_left(actors):
    """A receiver that closes and attaches again at once: its planner forgets the first
    registration before it hears of the second. It heard of them the other way round
    when forgetting took a while (shared memory tells each node's owner in turn), and
    the owners then dropped the new registration: no slot held for it, a zero-copy
    model's segment free to be rewritten under it."""
    register_transport("slow_leave", SlowLeaveTransport)
    hub = start_hub(actors, "slow_leave", models=["m"])
    ray.get(hub.broadcast.remote(special_weights(1.0), model="m"))
    first = raysync.attach(hub, {"m": special_weights(0.0)}, mode="pull", heartbeat_s=None)
    worker = first.worker
    first.close()
    again = raysync.attach(
        hub, {"m": special_weights(0.0)}, worker_id=worker, mode="pull", heartbeat_s=None
    )
    try:
        events = ray.get(hub.actor.__ray_call__.remote(planner_events, "slow_leave"))
        assert events == [("joined", worker), ("left", worker), ("joined", worker)]
    finally:
        again.close()


def test_a_receiver_that_moves_to_another_transport_and_back_joins_after_it_left(actors):
    """As above, through two moves (``replaces=``, another transport, then the first
    again): the first move's departure from the first transport's planner was not
    waited for, and it forgot the registration that came back to it."""
    register_transport("slow_leave", SlowLeaveTransport)
    hub = start_hub(actors, "slow_leave", models=["m"])
    ray.get(hub.broadcast.remote(special_weights(1.0), model="m"))
    first = raysync.attach(hub, {"m": special_weights(0.0)}, mode="pull", heartbeat_s=None)
    worker = first.worker

    def move(transport: str, replaces: raysync.AttachedReceiver) -> raysync.AttachedReceiver:
        return raysync.attach(
            hub,
            {"m": special_weights(0.0)},
            worker_id=worker,
            mode="pull",
            heartbeat_s=None,
            transport=transport,
            replaces=replaces,
        )

    back = move("slow_leave", move("object_store", first))
    try:
        events = ray.get(hub.actor.__ray_call__.remote(planner_events, "slow_leave"))
        assert events == [("joined", worker), ("left", worker), ("joined", worker)]
    finally:
        back.close()


def test_a_receiver_dropped_while_its_transport_takes_it_in_is_forgotten_there(actors):
    """A registration dropped while its transport's planner was taking it in (the
    receiver died, and a broadcast's call found it dead): the planner forgot it and then
    took it in, and the hub went on registering it, for a dead caller. The planner held
    it (a shared-memory slot planned for its catch-up) for good."""
    register_transport("held_join", HeldJoinTransport)
    hub = start_hub(actors, "held_join", models=["m"])
    outcome: list[BaseException] = []

    def attach() -> None:
        try:
            raysync.attach(
                hub, {"m": special_weights(0.0)}, worker_id="w", mode="pull", heartbeat_s=None
            )
        except BaseException as err:  # reported in the test's thread
            outcome.append(err)

    attaching = threading.Thread(target=attach)
    attaching.start()
    wait_until(
        lambda: ray.get(hub.actor.__ray_call__.remote(joins_waiting, "held_join")) == 1,
        what="the planner taking w in",
    )
    token = ray.get(hub.actor.__ray_call__.remote(token_of, "w"))
    ray.get(hub.actor.leave.remote("w", token))  # what the hub does for a dead receiver
    ray.get(hub.actor.__ray_call__.remote(let_joins_go, "held_join"))
    attaching.join(60)
    assert len(outcome) == 1 and "w was dropped while it registered" in str(outcome[0])
    wait_until(
        lambda: ray.get(hub.actor.__ray_call__.remote(planner_events, "held_join"))
        == [("left", "w"), ("joined", "w"), ("left", "w")],
        what="the planner forgetting w once it took it in",
    )
    assert ray.get(hub.status.remote()).receivers == ()


def test_a_receiver_registering_with_a_closed_hub_is_refused(actors):
    """A closed hub's planners and background tasks are closed: a registration after
    close opened them again (a node's shared-memory owner, the lease keeper), for as
    long as the hub actor lived."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    ray.get(hub.close.remote())
    with pytest.raises(HubClosedError, match="cannot register with it"):
        raysync.attach(hub, {"m": special_weights(0.0)}, mode="pull", heartbeat_s=None)


def test_drop_if_dead_drops_the_receivers_whose_actor_died_and_keeps_the_others(actors):
    """Whoever ended actors with receivers (a RayCollector's scheme at shutdown) has the
    hub drop them at once: a live one, an unknown name and one in no actor are kept."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    ended, live = (start(actors, Collector, hub, worker_id=w) for w in ("ended", "live"))
    ready([ended, live])
    driver = raysync.attach(
        hub, {"policy": make_policy()}, mode="pull", heartbeat_s=None, worker_id="driver"
    )
    try:
        ray.kill(ended)
        wait_dead(ended)  # else the hub's call may still reach it
        workers = ["ended", "live", "unknown", "driver"]
        assert ray.get(hub.drop_if_dead.remote(workers)) == ("ended",)
        status = ray.get(hub.status.remote())
        assert sorted(r.worker for r in status.receivers) == sorted(workers[1::2])
    finally:
        driver.close()


def test_a_registration_whose_transport_never_takes_it_in_fails_within_the_hubs_timeout(
    actors,
):
    """A planner that never answers (a node's resource actor hung) held each
    registration's call in the hub for ever, one more of its concurrent calls each time
    a receiver or its watch tried again. It fails within the hub's timeout, naming the
    transport, and the hub goes on answering."""
    register_transport("hanging_join", HangingJoinTransport)
    hub = start_hub(actors, "hanging_join", timeout_s=2)
    with pytest.raises(TransportError, match="'hanging_join' did not take .* within 2 s"):
        raysync.attach(hub, {"m": special_weights(0.0)}, mode="pull", heartbeat_s=None)
    status = ray.get(hub.status.remote(), timeout=30)
    assert status.receivers == () and "hanging_join" in str(status.refused)

"""The direct path: the learner calls the receivers itself and the hub books the version
in parallel (see ``raysync.messages.Route``). Every guarantee of a broadcast through the
hub holds: versions 1, 2, 3 in the hub's order, acks per worker, late joiners, failures
named, and two learners are routed numbers of their own, in the hub's order."""

from __future__ import annotations

import dataclasses

import pytest
import ray
import torch

from raysync import StaleVersionError, UnknownModelError, hub_handle
from raysync.testing import assert_bitwise, special_weights
from raysync.transports.shared_memory import OWNER_NAMESPACE, owner_name
from tests.helpers import (
    Gate,
    assert_same,
    hold_until_opened,
    ready,
    start,
    start_hub,
    wait_dead,
    wait_until,
)
from tests.receivers import (
    AsyncLeaver,
    Collector,
    Holder,
    HookCaller,
    Labeller,
    OtherLearner,
    connect_policy_again,
    make_policy,
    state_of,
)


def _hold(collectors, learner, version: int) -> None:
    """Every collector holds ``learner``'s weights bit for bit, as ``version``."""
    for c in collectors:
        assert ray.get(c.version.remote()) == version
        assert_same(ray.get(c.state.remote()), state_of(learner))


def test_the_learner_delivers_each_version_itself(actors):
    hub = start_hub(actors, "object_store")
    collectors = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(3)]
    ready(collectors)
    for expected in range(1, 5):
        learner = make_policy()
        report = ray.get(hub.broadcast.remote(learner))
        assert (report.version, report.acked) == (expected, ("c0", "c1", "c2"))
        assert report.direct == ("c0", "c1", "c2")
        _hold(collectors, learner, expected)
        phases = report.phases
        assert phases is not None and phases.fetch_s.max <= phases.deliver_s.max
        assert phases.deliver_s.max <= report.seconds
    status = ray.get(hub.status.remote())
    assert status.versions == {"policy": 4}
    assert {r.worker: r.lag["policy"] for r in status.receivers} == {"c0": 0, "c1": 0, "c2": 0}


def test_broadcasts_through_the_hub_and_direct_ones_share_one_count(actors):
    hub = start_hub(actors, "object_store")
    a = start(actors, Collector, hub, worker_id="a")
    b = start(actors, Collector, hub, worker_id="b")
    ready([a, b])
    assert ray.get(hub.broadcast.remote(make_policy())).direct == ("a", "b")
    only_b = make_policy()
    report = ray.get(hub.broadcast.remote(only_b, workers=["b"]))  # a subset: direct too
    assert (report.version, report.acked, report.direct) == (2, ("b",), ("b",))
    _hold([b], only_b, 2)
    late = start(actors, Collector, hub, worker_id="late")
    ready([late])
    to_late = make_policy()  # names a worker the route does not list: through the hub
    report = ray.get(hub.broadcast.remote(to_late, workers=["late"]))
    assert (report.version, report.acked, report.direct) == (3, ("late",), ())
    _hold([late], to_late, 3)
    stepped = make_policy()
    report = ray.get(hub.broadcast.remote(stepped, version=10))  # explicit: through the hub
    assert (report.version, report.direct) == (10, ())
    last = make_policy()
    report = ray.get(hub.broadcast.remote(last))
    assert (report.version, report.direct) == (11, ("a", "b", "late"))
    _hold([a, b, late], last, 11)


def test_workers_named_by_a_generator_are_the_targets_of_a_direct_broadcast(actors):
    """The learner read ``workers`` twice: whether the route lists them, then for the
    request. A generator was used up by the first: the version was booked with no
    target, reported a success and reached nobody."""
    hub = start_hub(actors, "object_store")
    a = start(actors, Collector, hub, worker_id="a")
    b = start(actors, Collector, hub, worker_id="b")
    ready([a, b])
    ray.get(hub.broadcast.remote(make_policy()))  # the route: the next one goes direct
    only_b = make_policy()
    report = ray.get(hub.broadcast.remote(only_b, workers=(w for w in ["b"])))
    assert (report.version, report.acked, report.direct) == (2, ("b",), ("b",))
    _hold([b], only_b, 2)


def test_a_receiver_that_joined_after_the_route_gets_the_version_from_the_hub(actors):
    hub = start_hub(actors, "object_store")
    early = start(actors, Collector, hub, worker_id="early")
    ready([early])
    ray.get(hub.broadcast.remote(make_policy()))  # the next route is asked here
    late = start(actors, Collector, hub, worker_id="late")
    ready([late])
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner))
    assert report.acked == ("early", "late") and report.direct == ("early",)
    _hold([early, late], learner, 2)


def test_each_result_brings_the_next_route_and_a_handle_travels_once(actors):
    """The learner asks for a route only before its first broadcast: each report
    carries the next one, without the handles the learner already holds."""
    hub = start_hub(actors, "object_store")
    a = start(actors, Collector, hub, worker_id="a")
    ready([a])
    asked = []
    ask = hub._ask_route
    hub._ask_route = lambda *args: asked.append(args) or ask(*args)
    for expected in range(1, 4):
        report = ray.get(hub.broadcast.remote(make_policy()))
        assert (report.version, report.direct) == (expected, ("a",))
        assert report.route.next_version == expected + 1
        assert [(t.worker, t.handle) for t in report.route.targets] == [("a", None)]
    assert len(asked) == 1
    b = start(actors, Collector, hub, worker_id="b")
    ready([b])
    report = ray.get(hub.broadcast.remote(make_policy()))  # b joined after the route
    assert (report.acked, report.direct) == (("a", "b"), ("a",))
    assert {t.worker: t.handle is None for t in report.route.targets} == {"a": True, "b": False}
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner))
    assert (report.version, report.direct) == (5, ("a", "b"))
    _hold([a, b], learner, 5)
    ticket = ray.get(hub.broadcast.remote(make_policy(), wait=False))
    assert ticket.route.next_version == 7
    report = ray.get(hub.wait_for.remote(ticket))
    assert (report.version, report.direct) == (6, ("a", "b"))
    assert len(asked) == 1


def test_a_learner_that_lets_its_side_go_after_each_broadcast_numbers_them_1_2_3(actors):
    """``release()`` has the hub forget the learner's number; the learner side this
    process makes for its next broadcast asks for a route right after. The hub forgot
    the number only after an await, so that route was often answered first: it held a
    number past the forgotten learner's, and one version in three skipped one."""
    hub = start_hub(actors, "object_store")
    collector = start(actors, Collector, hub)
    ready([collector])
    learners = [make_policy() for _ in range(12)]  # made ahead: release() and the next
    versions = []  # broadcast follow each other at once, as in a training loop
    for learner in learners:
        versions.append(ray.get(hub.broadcast.remote(learner)).version)
        hub.release()
    assert versions == list(range(1, 13))
    _hold([collector], learners[-1], 12)


def test_two_learners_are_routed_numbers_of_their_own_in_the_hubs_order(actors):
    first = start_hub(actors, "object_store")
    second = start(actors, OtherLearner, first)  # another learner of the same hub
    collectors = [start(actors, Collector, first, worker_id=f"c{i}") for i in range(2)]
    ready(collectors)
    one = ray.get(first.broadcast.remote(make_policy()))
    two = ray.get(second.broadcast.remote(make_policy()))
    # The first learner's report routed it 2: the second's route names 3, its own.
    assert (one.version, one.direct) == (1, ("c0", "c1"))
    assert (two.version, two.direct) == (3, ("c0", "c1"))
    learner = make_policy()
    three = ray.get(first.broadcast.remote(learner))
    # The first learner delivered it as 2, its route's, overtaken by the second's 3:
    # the receivers answer SUPERSEDED, and the hub versions it anew above the number
    # the second's report routed it (4) and delivers it itself. 2 is nobody's.
    assert (three.version, three.direct, three.acked) == (5, (), ("c0", "c1"))
    _hold(collectors, learner, 5)
    assert ray.get(first.status.remote()).versions == {"policy": 5}


def test_two_learners_at_once_never_label_two_weights_with_one_version(actors):
    """Two learner processes broadcast one model at once, neither waiting for a report
    before its next broadcast, each filling the weights with a value of its own. Each
    learner's route names a version number of its own, and the hub numbers a broadcast
    above the numbers routed to the other: no receiver ever applies one learner's
    weights under a number the hub booked for the other's (before, the two guessed the
    same numbers, and a receiver reached by one learner's own delivery first held its
    weights under the other's number until the hub's delivery of it came)."""
    hub = start_hub(actors, "object_store")
    receivers = [start(actors, Labeller, hub, worker_id=f"r{i}") for i in range(2)]
    learners = [start(actors, OtherLearner, hub) for _ in range(2)]
    ready(receivers + learners)
    values = [[1000.0 * (k + 1) + i for i in range(15)] for k in range(2)]
    sent = ray.get([x.broadcast_filled.remote(v) for x, v in zip(learners, values, strict=True)])
    labels: dict[int, set[float]] = {}
    for version, value in sent[0] + sent[1]:
        labels.setdefault(version, set()).add(value)
    assert len(labels) == 30  # a number each
    for receiver in receivers:
        applied = ray.get(receiver.applied_labels.remote())
        assert applied, "nothing applied"
        for version, value in applied:
            labels.setdefault(version, set()).add(value)
    assert {v: sorted(x) for v, x in labels.items() if len(x) > 1} == {}


@pytest.mark.parametrize("overtaking", [1, 2])
def test_two_learners_guessing_one_number_leave_zero_copy_models_in_slots_held(
    actors, overtaking
):
    """The same on ``shared_memory``, the receivers' models living in the slots: the
    second learner's ``overtaking`` broadcasts took numbers above the one the first
    learner's route named (2). Each receiver turned the first learner's own delivery of
    2 down as older than what it held and handed the slot back unread, and the hub,
    which versioned that broadcast anew and delivered this very slot itself, booked no
    hold for the learner's call. The owner took the hand-back for the hold of the hub's
    delivery: the zero-copy models then lived in a slot held by nobody but ``latest``,
    which the next version moves off."""
    first = start_hub(actors, "shared_memory")
    second = start(actors, OtherLearner, first)
    collectors = [
        start(actors, Collector, first, worker_id=f"c{i}", zero_copy=True) for i in range(2)
    ]
    ready(collectors)
    ray.get(first.broadcast.remote(make_policy()))  # routes the first learner 2
    for version in range(3, 3 + overtaking):  # above 2, routed to the first
        assert ray.get(second.broadcast.remote(make_policy())).version == version
    learner = make_policy()
    report = ray.get(first.broadcast.remote(learner))  # delivered by it as 2
    # Versioned anew above the number the second's last report routed it.
    anew = 4 + overtaking
    assert (report.version, report.direct, report.acked) == (anew, (), ("c0", "c1"))
    _hold(collectors, learner, anew)
    node_id = ray.get_runtime_context().get_node_id()
    owner = ray.get_actor(owner_name(first.config.hub_id, node_id), namespace=OWNER_NAMESPACE)
    assert {"worker/c0", "worker/c1"} <= set(ray.get(owner.stats.remote()).holds)


def test_a_taken_version_whose_named_receiver_left_is_versioned_anew_and_fails_it(actors):
    """The first learner delivered its broadcast to the workers it named under a number
    the second learner's overtook, and one of them left meanwhile: the hub versions it anew
    and delivers it to the one still there, failing the other (it raised
    UnknownWorkerError though a receiver had the learner's call)."""
    first = start_hub(actors, "object_store")
    second = start(actors, OtherLearner, first)
    stays, other = (start(actors, Collector, first, worker_id=w) for w in ("stays", "other"))
    ready([stays, other])
    ray.get(first.broadcast.remote(make_policy()))  # version 1; the route lists both
    assert ray.get(second.broadcast.remote(make_policy())).version == 3  # above 2, routed
    ray.get(other.__ray_call__.remote(lambda c: c._raysync_connected().close()))
    learner = make_policy()
    report = ray.get(
        first.broadcast.remote(learner, workers=["stays", "other"], raise_on_failure=False)
    )
    assert (report.version, report.direct, report.acked) == (5, (), ("stays",))
    assert "left the hub" in report.failed["other"], report.failed
    _hold([stays], learner, 5)


def test_a_receiver_killed_after_the_route_is_reported_dead(actors):
    hub = start_hub(actors, "object_store")
    survivor = start(actors, Collector, hub, worker_id="survivor")
    victim = start(actors, Collector, hub, worker_id="victim")
    ready([survivor, victim])
    ray.get(hub.broadcast.remote(make_policy()))  # the next route lists the victim
    ray.kill(victim, no_restart=True)
    wait_dead(victim)  # else the learner's call may still reach it
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner, raise_on_failure=False))
    assert report.acked == ("survivor",)
    assert "victim" in report.failed and "died" in report.failed["victim"]
    _hold([survivor], learner, 2)
    after = ray.get(hub.broadcast.remote(make_policy()))  # dropped from the registry
    assert after.acked == ("survivor",) and after.failed == {}


@pytest.mark.parametrize(
    ("departure", "said"),
    [("left", "left the hub"), ("moved", "the next version reaches it")],
)
def test_a_named_receiver_that_left_or_moved_after_the_route_is_reported(actors, departure, said):
    """It closed (left the hub), or registered again by a transport the learner's
    version was not handed over in: the report fails it, saying why (one that moved was
    in neither list)."""
    hub = start_hub(actors, "object_store")
    stays = start(actors, Collector, hub, worker_id="stays")
    other = start(actors, Collector, hub, worker_id="other")
    ready([stays, other])
    ray.get(hub.broadcast.remote(make_policy()))  # the next route lists both
    if departure == "left":
        ray.get(other.__ray_call__.remote(lambda c: c._raysync_connected().close()))
    else:
        ray.get(other.__ray_call__.remote(connect_policy_again, hub, transport="shared_memory"))
    learner = make_policy()
    report = ray.get(
        hub.broadcast.remote(learner, workers=["stays", "other"], raise_on_failure=False)
    )
    assert report.acked == ("stays",) and report.direct == ("stays",)
    assert said in report.failed["other"], report.failed
    _hold([stays], learner, 2)
    if departure == "left":
        assert ray.get(other.version.remote()) == 1  # closed: it applied nothing more
        return
    learner = make_policy()  # the learner hands shared memory's form over from now on
    report = ray.get(hub.broadcast.remote(learner, workers=["stays", "other"]))
    assert report.acked == ("other", "stays")
    _hold([stays, other], learner, 3)


def _delivered_but_never_booked(actors, monkeypatch):
    """A hub and its receiver "a", which holds version 2 from its learner's own delivery
    (this process's), the hub having booked version 1 only: ``(hub, a)``."""
    hub = start_hub(actors, "object_store")
    a = start(actors, Collector, hub, worker_id="a")
    ready([a])
    ray.get(hub.broadcast.remote(make_policy()))  # version 1, and the route
    deliver = hub_handle.deliver_directly

    def then_fail(*args, **kwargs):
        calls = deliver(*args, **kwargs)
        ray.get([ref for _, ref in calls.values()])  # applied, whatever comes next
        raise RuntimeError("the request could not be sent (injected)")

    monkeypatch.setattr(hub_handle, "deliver_directly", then_fail)
    with pytest.raises(RuntimeError, match="injected"):
        hub.broadcast.remote(make_policy())
    monkeypatch.undo()
    assert ray.get(a.version.remote()) == 2
    return hub, a


def test_a_version_delivered_directly_but_never_booked_may_not_be_named_again(actors, monkeypatch):
    """Named explicitly (whole, or in parts), the hub booked it and the receiver, holding
    that number, acked it as held: with the failed broadcast's weights."""
    hub, a = _delivered_but_never_booked(actors, monkeypatch)
    held = ray.get(a.state.remote())
    with pytest.raises(StaleVersionError, match="version 2 .* this learner delivered"):
        ray.get(hub.broadcast.remote(make_policy(), version=2))
    weights = make_policy().state_dict()
    halves = [dict(list(weights.items())[:2]), dict(list(weights.items())[2:])]
    parts = [hub.broadcast.remote(h, version=2, part=i, parts=2) for i, h in enumerate(halves)]
    for part in parts:
        with pytest.raises(StaleVersionError, match="version 2 .* this learner delivered"):
            ray.get(part)
    assert_same(ray.get(a.state.remote()), held)
    learner = make_policy()
    assert ray.get(hub.broadcast.remote(learner, version=3)).acked == ("a",)
    _hold([a], learner, 3)


def test_a_version_delivered_directly_but_never_booked_is_not_numbered_again(actors, monkeypatch):
    """The learner delivered version 2 itself, then failed before the hub booked it (its
    request could not be sent): receivers hold it as version 2. The next broadcast,
    numbered by the hub, must not be version 2 again: its receivers would keep the
    failed one's weights and be counted as having applied the new ones."""
    hub, a = _delivered_but_never_booked(actors, monkeypatch)
    late = start(actors, Collector, hub, worker_id="late")
    ready([late])
    learner = make_policy()  # names a worker the route does not list: through the hub
    report = ray.get(hub.broadcast.remote(learner, workers=["a", "late"]))
    assert (report.version, report.acked, report.direct) == (3, ("a", "late"), ())
    _hold([a, late], learner, 3)


def test_a_model_named_or_left_out_is_one_model_to_the_learner(actors):
    # The learner keeps the route its last broadcast brought back, per model: one
    # broadcast naming "policy" moves the next version of one that leaves it out (else
    # that one is delivered as a version already taken, then again by the hub).
    hub = start_hub(actors, "object_store")
    collectors = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(2)]
    ready(collectors)
    assert ray.get(hub.broadcast.remote(make_policy())).version == 1
    named = make_policy()
    report = ray.get(hub.broadcast.remote(named, model="policy", version=5))
    assert report.version == 5
    _hold(collectors, named, 5)
    unnamed = make_policy()
    report = ray.get(hub.broadcast.remote(unnamed))
    assert (report.version, report.acked, report.direct) == (6, ("c0", "c1"), ("c0", "c1"))
    _hold(collectors, unnamed, 6)


def test_a_broadcast_leaving_the_model_out_is_refused_once_the_hub_holds_two(actors):
    """A route names its model; one that a broadcast leaving the model out brought back
    (or one naming it) let the learner's next ones go on as that model's, directly,
    after a second model registered: another model's weights could be published as the
    first's, or refused, as the previous broadcast had gone. A route made while the
    hub holds two says so (a route is one broadcast old: the first one made since)."""
    hub = start_hub(actors, "object_store")
    collector = start(actors, Collector, hub, worker_id="c0")
    ready([collector])
    assert ray.get(hub.broadcast.remote(make_policy())).direct == ("c0",)
    ready([start(actors, Holder, hub, {"w": torch.zeros(4)}, "critic", model="critic")])
    named = make_policy()
    assert ray.get(hub.broadcast.remote(named, model="policy")).direct == ("c0",)
    _hold([collector], named, 2)
    with pytest.raises(UnknownModelError, match="several models"):
        ray.get(hub.broadcast.remote(make_policy()))
    _hold([collector], named, 2)


@ray.remote(num_cpus=0)
class ValueLog(Collector.__ray_actor_class__):  # type: ignore[name-defined]
    """A Collector that notes, per version applied, its policy's first weight."""

    def on_weights_applied(self, model: str, version: int) -> None:
        super().on_weights_applied(model, version)
        self.values = [*getattr(self, "values", []), (version, self.policy[0].weight[0, 0].item())]

    def applied_values(self) -> list[tuple[int, float]]:
        return list(getattr(self, "values", []))


def test_a_route_another_broadcast_of_this_learner_made_stale_goes_through_the_hub(
    actors, monkeypatch
):
    """Two threads of one learner: one reads its route (next version V), the other
    broadcasts through the hub meanwhile (here: naming V), and the hub gives that one
    V. The first then delivered V itself, with its own weights: every receiver held its
    weights as V and took the hub's V (the other's weights, from the same learner) as
    already held, so the other's report said they applied what they never held. A
    route a later submit of the same model made stale is not delivered directly: the
    hub numbers that version."""
    hub = start_hub(actors, "object_store")
    collectors = [start(actors, ValueLog, hub, worker_id=f"c{i}") for i in range(2)]
    ready(collectors)
    v = ray.get(hub.broadcast.remote(make_policy())).version + 1
    first, second = make_policy(), make_policy()
    meanwhile: list = []
    hand_off = hub_handle._Broadcast._hand_off

    def another_broadcast_leaves_first(self, *args, **kwargs):
        if not meanwhile:  # between this broadcast's route and its submit
            meanwhile.append(None)  # the other broadcast's own hand-off comes here too
            meanwhile[0] = hub.broadcast.remote(first, version=v)
        return hand_off(self, *args, **kwargs)

    monkeypatch.setattr(hub_handle._Broadcast, "_hand_off", another_broadcast_leaves_first)
    late = ray.get(hub.broadcast.remote(second))
    early = ray.get(meanwhile[0])
    assert (early.version, early.acked) == (v, ("c0", "c1"))
    assert (late.version, late.acked) == (v + 1, ("c0", "c1"))
    for collector in collectors:
        values = dict(ray.get(collector.applied_values.remote()))
        assert values[v] == first[0].weight[0, 0].item(), values
        assert values[v + 1] == second[0].weight[0, 0].item(), values
    _hold(collectors, second, v + 1)


def test_a_receiver_that_applied_a_version_whose_learner_died_is_not_blamed(actors):
    """The learner delivers a version itself and dies before its receiver's reply came
    back: the reply, which reaches the hub through the learner that owns the call, is
    lost with it. The hub reported the receiver as having raised while receiving (it
    applied the version) and its books kept it a version behind; it now asks the
    receiver itself, which says it holds the version."""
    hub = start_hub(actors, "shared_memory")
    holder = start(actors, Holder, hub, special_weights(0.0), "r")
    ready([holder])
    learner = start(actors, OtherLearner, hub)
    ray.get(learner.broadcast.remote(special_weights(1.0), model="m"))  # its route, now
    gate = start(actors, Gate)
    busy = hold_until_opened(actors, holder, gate)  # the learner's call to it waits behind this
    weights = special_weights(2.0)
    ticket = ray.get(learner.broadcast.remote(weights, model="m", wait=False))
    ray.kill(learner, no_restart=True)
    wait_dead(learner)
    ray.get(gate.open.remote())
    ray.get(busy)
    report = ray.get(hub.wait_for.remote(ticket, raise_on_failure=False), timeout=60)
    assert (report.version, report.acked, report.failed) == (2, ("r",), {})
    assert report.direct == ()  # the hub's own call is what answered
    assert_bitwise(ray.get(holder.state.remote()), weights)
    status = ray.get(hub.status.remote())
    assert {r.worker: r.versions for r in status.receivers} == {"r": {"m": 2}}


def _book_once_it_left(hub, monkeypatch, worker: str, first=lambda: None) -> None:
    """The learner's next booking of a version (its submit, after its own delivery
    calls) waits for ``first()``, then until ``worker``'s leaving reached the hub."""
    side = hub._side
    submit = side.submit

    def book_once_it_left(send):
        first()
        wait_until(
            lambda: worker not in {r.worker for r in ray.get(hub.status.remote()).receivers},
            what=f"{worker}'s leaving reaching the hub",
        )
        return submit(send)

    monkeypatch.setattr(side, "submit", book_once_it_left)


@pytest.mark.parametrize("workers", [None, ["caller", "other"]])
def test_a_receiver_that_left_once_it_applied_the_learners_delivery_is_acked(
    actors, monkeypatch, workers
):
    """A receiver whose hook closes it on applying version 2 (delivered by the learner)
    left the hub before the learner's booking of that version reached it: the hub
    counted neither an ack nor a failure for it (named: failed, "left the hub"), as if
    it had never held the version. It reads the learner's call: the receiver applied
    it, so it is acked."""
    hub = start_hub(actors, "object_store")
    caller = start(actors, HookCaller, hub, "caller", close_at=2)
    other = start(actors, Collector, hub, worker_id="other")
    ready([caller, other])
    assert ray.get(hub.broadcast.remote(make_policy())).acked == ("caller", "other")
    _book_once_it_left(hub, monkeypatch, "caller")
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner, workers=workers), timeout=60)
    assert (report.version, report.acked, report.failed) == (2, ("caller", "other"), {})
    assert report.direct == ("caller", "other")
    sums = ray.get(caller.seen_sums.remote())
    assert sums[-1] == pytest.approx(float(sum(t.sum() for t in state_of(learner).values())))


def test_a_receiver_that_left_once_it_applied_a_deferred_learners_delivery_is_acked(
    actors, monkeypatch
):
    """As above, with the version deferred: the learner's call reached the receiver while
    a coroutine held its policy (its reply: None), the version was applied once that
    returned, and its ack came apart, before the booking. The hub read only the call's
    reply: the receiver, named, was failed as having left without the version."""
    hub = start_hub(actors, "object_store")
    leaver = start(actors, AsyncLeaver, hub, "leaver", close_at=2)
    other = start(actors, Collector, hub, worker_id="other")
    ready([leaver, other])
    assert ray.get(hub.broadcast.remote(make_policy())).acked == ("leaver", "other")
    entered, leave = start(actors, Gate), start(actors, Gate)
    holding = leaver.hold.remote(entered, leave)
    ray.get(entered.wait.remote())

    def let_it_apply() -> None:
        ray.get(leave.open.remote())
        ray.get(holding)

    _book_once_it_left(hub, monkeypatch, "leaver", first=let_it_apply)
    learner = make_policy()
    report = ray.get(hub.broadcast.remote(learner, workers=["leaver", "other"]), timeout=60)
    assert (report.version, report.acked, report.failed) == (2, ("leaver", "other"), {})
    assert_same(ray.get(leaver.state.remote()), state_of(learner))


@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named before"])
def test_a_version_delivered_but_never_booked_is_not_numbered_again_by_the_hub(
    actors, monkeypatch, named
):
    """The learner delivered version 2 itself and its booking never reached the hub (as
    when the hub dies first). Its next route listed no receiver (a restarted hub that
    knows none yet), so it named no model, and the learner looked its last direct
    version up under that empty name: the hub numbered the next version 2 again, and
    every receiver, holding 2 from this learner, took it as held, with 2's weights.
    (``named before``: the earlier broadcasts named the model, so the learner did not
    know which model an unnamed one is.)"""
    hub = start_hub(actors, "object_store")
    collectors = [start(actors, ValueLog, hub, worker_id=f"c{i}") for i in range(2)]
    ready(collectors)
    before = {"model": "policy"} if named else {}
    assert ray.get(hub.broadcast.remote(make_policy(), **before)).version == 1
    side = hub._side
    submit = side.submit

    def lost_before_booked(send):
        raise RuntimeError("the hub went away before it booked the version")

    monkeypatch.setattr(side, "submit", lost_before_booked)
    unbooked = make_policy()
    with pytest.raises(RuntimeError, match="before it booked"):
        hub.broadcast.remote(unbooked, **before)
    _hold(collectors, unbooked, 2)
    monkeypatch.setattr(side, "submit", submit)
    route = hub._route

    def knows_no_receiver_yet(model, timeout_s):
        return dataclasses.replace(
            route(model, timeout_s), model="", next_version=0, spec=None, targets=()
        )

    monkeypatch.setattr(hub, "_route", knows_no_receiver_yet)
    third = make_policy()
    report = ray.get(hub.broadcast.remote(third), timeout=60)
    assert (report.version, report.acked) == (3, ("c0", "c1"))
    _hold(collectors, third, 3)


def test_a_learner_holding_a_route_delivers_nothing_once_the_hub_closed(actors):
    """A learner's route from before the hub closed still names the receivers: the
    closing hub told each (by its registration) to refuse a learner's own delivery, so
    none applies a version the hub never books."""
    hub = start_hub(actors, "object_store")
    collectors = [start(actors, Collector, hub, worker_id=f"c{i}") for i in range(2)]
    ready(collectors)
    first = make_policy()
    assert ray.get(hub.broadcast.remote(first)).direct == ("c0", "c1")  # route held
    ray.get(hub.actor.close.remote())
    with pytest.raises(Exception, match="shut"):
        ray.get(hub.broadcast.remote(make_policy()))
    _hold(collectors, first, 1)

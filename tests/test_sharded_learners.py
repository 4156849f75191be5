"""Sharded learners: a version sent in parts by several learner processes. The kit's
``test_a_version_sent_in_parts_lands_whole`` runs it on every transport; here, on the
object store, what must fail does: a part that never comes, parts that overlap, that
leave keys out or hold keys the model lacks, a part whose bytes are lost before
receivers read them. In every case no receiver applies anything of that version."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from raysync import (
    BroadcastError,
    IncompleteVersionError,
    SpecMismatchError,
    UnknownModelError,
    WeightHub,
)
from raysync.testing import (
    MODEL,
    ConformanceReceiver,
    PartLearner,
    assert_bitwise,
    special_weights,
    split_in_parts,
)
from tests.helpers import Gate, hold_until_opened, ready, start, start_hub, wait_until
from tests.receivers import Holder

Receiver = ray.remote(num_cpus=0)(ConformanceReceiver)


@pytest.fixture(scope="module")
def pair(ray_cluster):
    """A hub and one receiver for the module's tests (none kills them)."""
    hub = WeightHub.remote(transport="object_store", models=[MODEL])
    receiver = Receiver.remote(hub, "r0")
    ray.get(receiver.__ray_ready__.remote())
    yield hub, receiver
    for handle in (hub.actor, receiver):
        ray.kill(handle)


@pytest.fixture
def hub_and_receiver(pair):
    """The module's hub and receiver, the receiver holding a fresh version ``v`` of
    ``special_weights(1.0)``: ``(hub, receiver, v)``. Each test numbers its parts'
    versions from ``v``."""
    hub, receiver = pair
    version = ray.get(hub.broadcast.remote(special_weights(1.0), model=MODEL), timeout=60).version
    return hub, receiver, version


def send_parts(hub, parts: list[dict], version: int, **kw) -> list[ray.ObjectRef]:
    """Every part from this process (the hub sees them as it would from several)."""
    return [
        hub.broadcast.remote(p, model=MODEL, version=version, part=i, parts=len(parts), **kw)
        for i, p in enumerate(parts)
    ]


def assert_untouched(receiver, version: int) -> None:
    """``receiver`` still holds ``version``, ``special_weights(1.0)``."""
    assert ray.get(receiver.version.remote()) == version
    assert_bitwise(ray.get(receiver.state.remote()), special_weights(1.0))


def test_a_part_that_never_arrives_fails_the_version_for_every_part(hub_and_receiver):
    hub, receiver, v = hub_and_receiver
    first, second = split_in_parts(special_weights(2.0), 2)
    alone = hub.broadcast.remote(first, model=MODEL, version=v + 1, part=0, parts=2, timeout_s=1)
    with pytest.raises(IncompleteVersionError, match=r"part\(s\) 1 did not arrive within 1 s"):
        ray.get(alone, timeout=30)
    late = hub.broadcast.remote(second, model=MODEL, version=v + 1, part=1, parts=2)
    with pytest.raises(IncompleteVersionError, match="part 1 .* arrived after the version failed"):
        ray.get(late, timeout=30)
    assert_untouched(receiver, v)
    assert ray.get(hub.status.remote()).assembling == {}
    # Its number is not used up: the learners send the version again, and it lands.
    weights = special_weights(3.0)
    reports = ray.get(send_parts(hub, split_in_parts(weights, 2), version=v + 1), timeout=60)
    assert reports[0] == reports[1] and reports[0].acked == ("r0",)
    assert reports[0].version == v + 1
    assert_bitwise(ray.get(receiver.state.remote()), weights)


def test_a_failed_version_is_sent_again_by_the_learner_whose_part_arrived(hub_and_receiver):
    """The rank whose part arrived sends it again before the late rank's part comes:
    its part begins a new attempt, the late part joins it, the version lands whole."""
    hub, receiver, v = hub_and_receiver
    first, _ = split_in_parts(special_weights(2.0), 2)
    alone = hub.broadcast.remote(first, model=MODEL, version=v + 1, part=0, parts=2, timeout_s=1)
    with pytest.raises(IncompleteVersionError, match=r"part\(s\) 1 did not arrive within 1 s"):
        ray.get(alone, timeout=30)
    weights = special_weights(3.0)
    reports = ray.get(send_parts(hub, split_in_parts(weights, 2), version=v + 1), timeout=60)
    assert {r.version for r in reports} == {v + 1} and reports[0].acked == ("r0",)
    assert_bitwise(ray.get(receiver.state.remote()), weights)


NAMES = sorted(special_weights())


@pytest.mark.parametrize(
    "first, second, refusal, reason",
    [
        (
            NAMES[:5],
            NAMES[4:],
            f"parts 0 and 1 .* both hold key\\(s\\) '{NAMES[4]}'",
            "part 1 was refused .*both hold",
        ),
        (
            NAMES[:3],
            NAMES[4:],
            f"do not add up .* missing key\\(s\\) '{NAMES[3]}'",
            "the whole was refused .*add up",
        ),
    ],
    ids=["overlapping", "leaving-a-key-out"],
)
def test_parts_that_do_not_make_the_model_are_refused_naming_the_key(
    hub_and_receiver, first, second, refusal, reason
):
    """The second part shows it: it is refused naming the key, the first part is told
    why the version failed, and nothing is applied."""
    hub, receiver, v = hub_and_receiver
    weights = special_weights(2.0)
    parts = [{k: weights[k] for k in first}, {k: weights[k] for k in second}]
    told, refused = send_parts(hub, parts, version=v + 1)
    with pytest.raises(SpecMismatchError, match=refusal):
        ray.get(refused, timeout=30)
    with pytest.raises(IncompleteVersionError, match=reason):
        ray.get(told, timeout=30)
    assert_untouched(receiver, v)


def test_a_first_part_refused_for_its_model_fails_the_parts_after_it_at_once(actors):
    """Part 0 names a model the hub does not know yet (its receivers are still
    starting): refused to its learner. A receiver of that model registers, then part 1
    arrives: it opened the version as if it were the first, and was told after the
    whole timeout that part 0 "did not arrive". The refusal fails the version for the
    parts after it, at once, saying why."""
    hub = start_hub(actors, "object_store", models=[MODEL])
    first, second = split_in_parts(special_weights(2.0), 2)
    refused = hub.broadcast.remote(first, model="late", version=1, part=0, parts=2)
    with pytest.raises(UnknownModelError, match="'late'"):
        ray.get(refused, timeout=30)
    receiver = start(actors, Holder, hub, special_weights(0.0), "r-late", "late")
    ready([receiver])
    told = hub.broadcast.remote(second, model="late", version=1, part=1, parts=2, timeout_s=120)
    with pytest.raises(IncompleteVersionError, match=r"part 0 was refused \(UnknownModelError"):
        ray.get(told, timeout=60)
    assert ray.get(receiver.version.remote()) == 0


def test_the_parts_after_a_first_refused_as_unknown_hear_why_while_it_is_unknown(actors):
    """Part 0 names a model nobody registered: refused. Part 1 comes while the model is
    still unknown: it raised a bare ``KeyError`` (the hub looked the model's spec up)
    instead of the version's failure."""
    hub = start_hub(actors, "object_store", models=[MODEL])
    first, second = split_in_parts(special_weights(2.0), 2)
    refused = hub.broadcast.remote(first, model="nobody", version=1, part=0, parts=2)
    with pytest.raises(UnknownModelError, match="'nobody'"):
        ray.get(refused, timeout=30)
    told = hub.broadcast.remote(second, model="nobody", version=1, part=1, parts=2)
    with pytest.raises(IncompleteVersionError, match=r"part 0 was refused \(UnknownModelError"):
        ray.get(told, timeout=30)


def test_a_part_with_a_key_the_model_lacks_or_a_wrong_shape_is_refused(hub_and_receiver):
    hub, receiver, v = hub_and_receiver
    first, second = split_in_parts(special_weights(2.0), 2)
    stranger = dict(second, extra=special_weights()["w"])
    refs = send_parts(hub, [first, stranger], version=v + 1)
    with pytest.raises(SpecMismatchError, match="key\\(s\\) the model does not have: 'extra'"):
        ray.get(refs[1], timeout=30)
    name = sorted(second)[0]
    reshaped = dict(second, **{name: second[name].reshape(-1)[:1].clone()})
    refs = send_parts(hub, [first, reshaped], version=v + 2)
    with pytest.raises(SpecMismatchError, match=f"key '{name}' has shape"):
        ray.get(refs[1], timeout=30)
    assert_untouched(receiver, v)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"part": 0}, "part and parts go together"),
        ({"parts": 2}, "part and parts go together"),
        ({"part": 2, "parts": 2, "version": 5}, r"part must be in \[0, parts\)"),
        ({"part": 0, "parts": 2}, "needs version=..."),
        ({"part": 0, "parts": 2.0, "version": 5}, r"parts must be an int, got 2\.0 \(float\)"),
        ({"part": True, "parts": 2, "version": 5}, r"part must be an int, got True \(bool\)"),
    ],
)
def test_bad_part_arguments_raise_in_the_learner(hub_and_receiver, kw, message):
    hub, receiver, v = hub_and_receiver
    with pytest.raises(ValueError, match=message):
        hub.broadcast.remote(special_weights(2.0), model=MODEL, **kw)
    assert_untouched(receiver, v)


@ray.remote
def _lost(nbytes: int) -> None:
    raise OSError(f"the node holding these {nbytes} bytes died")


@ray.remote(num_cpus=0)
class LosingLearner(PartLearner):
    """A learner whose part's bytes are lost once sent (as when its node dies): its
    object-store hand-off carries a ref that raises when read. Only this actor's
    process sends that way."""

    def __init__(self, hub) -> None:
        super().__init__(hub)
        from raysync.transports.object_store.learner import ObjectStoreSender
        from raysync.transports.object_store.wire import ObjectStorePayload

        def send_lost(sender, tensors, spec, model):
            return ObjectStorePayload((_lost.remote(spec.nbytes),))

        ObjectStoreSender.send = send_lost


def test_a_part_whose_bytes_are_lost_leaves_the_model_untouched(actors, hub_and_receiver):
    """Part 1's bytes cannot be read: every receiver fails the version (the error says
    so) after reading part 0, and applies nothing of it; sent again, it lands."""
    hub, receiver, v = hub_and_receiver
    first, second = split_in_parts(special_weights(2.0), 2)
    losing = start(actors, LosingLearner, hub)
    lost = losing.send.remote(second, version=v + 1, part=1, parts=2)
    with pytest.raises(BroadcastError) as info:
        ray.get(
            hub.broadcast.remote(first, model=MODEL, version=v + 1, part=0, parts=2), timeout=60
        )
    assert set(info.value.report.failed) == {"r0"}
    assert "could not read the object-store copy" in info.value.report.failed["r0"]
    with pytest.raises(BroadcastError):
        ray.get(lost, timeout=60)
    assert_untouched(receiver, v)
    assert ray.get(hub.status.remote()).assembling == {}
    # No receiver holds it: its number is not used up, and the version sent again lands.
    weights = special_weights(3.0)
    reports = ray.get(send_parts(hub, split_in_parts(weights, 2), version=v + 1), timeout=60)
    assert {r.version for r in reports} == {v + 1} and reports[0].acked == ("r0",)
    assert_bitwise(ray.get(receiver.state.remote()), weights)


def test_a_part_whose_learner_cancels_its_call_does_not_fail_the_others(actors):
    """A learner that gives up waiting on its own part's call (``ray.cancel``) while the
    version, started, waits for a busy receiver: the version and the other part's
    report go on as if it waited."""
    hub = start_hub(actors, "object_store", models=[MODEL])
    held = start(actors, Holder, hub, special_weights(), "held", MODEL)
    gate = start(actors, Gate)
    ready([held])
    blocked = hold_until_opened(actors, held, gate)  # the version's delivery waits behind this
    weights = special_weights(2.0)
    first, second = send_parts(hub, split_in_parts(weights, 2), version=1)
    wait_until(lambda: ray.get(hub.status.remote()).versions.get(MODEL) == 1, what="version 1")
    ray.cancel(first)
    ray.get(gate.open.remote())
    ray.get(blocked)
    report = ray.get(second, timeout=60)
    assert report.version == 1 and report.acked == ("held",) and not report.failed
    assert ray.get(hub.wait_for.remote(report), timeout=60).acked == ("held",)
    assert_bitwise(ray.get(held.state.remote()), weights)


def test_a_version_in_parts_is_delivered_within_its_timeout_of_the_first_part(actors):
    """The whole version's delivery has ``timeout_s`` from its first part's arrival (the
    README's promise): a busy receiver failed it ``timeout_s`` after the *last* part,
    so learners whose parts were spread out waited up to twice as long."""
    hub = start_hub(actors, "object_store", models=[MODEL])
    held = start(actors, Holder, hub, special_weights(), "held", MODEL)
    gate = start(actors, Gate)
    ready([held])
    blocked = hold_until_opened(actors, held, gate)  # busy past the version's timeout
    first, second = split_in_parts(special_weights(2.0), 2)
    timeout_s, later_s = 6.0, 5.0  # the slack, later_s - 0.5, covers a loaded machine
    sent = time.monotonic()
    refs = [
        hub.broadcast.remote(first, model=MODEL, version=1, part=0, parts=2, timeout_s=timeout_s)
    ]
    wait_until(lambda: ray.get(hub.status.remote()).assembling != {}, what="part 0 waiting")
    time.sleep(max(0.0, later_s - (time.monotonic() - sent)))  # the other rank's part, later
    refs.append(
        hub.broadcast.remote(second, model=MODEL, version=1, part=1, parts=2, timeout_s=timeout_s)
    )
    with pytest.raises(BroadcastError, match="held"):
        ray.get(refs[1], timeout=60)
    waited = time.monotonic() - sent
    ray.get(gate.open.remote())
    ray.get(blocked)
    # Failed at its timeout from part 0 (6 s), not from part 1 (11 s): the bound is loose.
    assert timeout_s <= waited < timeout_s + later_s - 0.5, waited


def test_parts_that_name_no_model_go_where_the_first_went_after_another_registered(actors):
    """The parts name no model: the hub took part 0 for its only model. Another model's
    receiver registers before part 1 arrives: part 1 was refused as ambiguous, and part
    0 waited out the whole timeout. Part 1 goes where part 0 went."""
    hub = start_hub(actors, "object_store")
    receiver = start(actors, Holder, hub, special_weights(0.0), "r-only", MODEL)
    ready([receiver])
    first, second = split_in_parts(special_weights(2.0), 2)
    sent = [hub.broadcast.remote(first, version=1, part=0, parts=2, timeout_s=120)]
    wait_until(
        lambda: ray.get(hub.status.remote()).assembling == {(MODEL, 1): (0,)},
        what="part 0 assembling",
    )
    ready([start(actors, Holder, hub, special_weights(0.0), "r-other", "other")])
    sent.append(hub.broadcast.remote(second, version=1, part=1, parts=2, timeout_s=120))
    reports = ray.get(sent, timeout=60)
    assert [r.acked for r in reports] == [("r-only",)] * 2
    assert ray.get(receiver.version.remote()) == 1
    assert_bitwise(ray.get(receiver.state.remote()), special_weights(2.0))


def test_a_part_that_names_no_model_among_several_fails_the_version_it_came_for(actors):
    """Part 0 names its model; part 1 names none while the hub holds two models: part
    1 is refused as ambiguous, and part 0 waited out its whole timeout, then was told
    part 1 never came. The one version of that number assembling hears the refusal."""
    hub = start_hub(actors, "object_store")
    receivers = [
        start(actors, Holder, hub, special_weights(0.0), f"r-{model}", model)
        for model in (MODEL, "other")
    ]
    ready(receivers)
    first, second = split_in_parts(special_weights(2.0), 2)
    named = hub.broadcast.remote(first, model=MODEL, version=1, part=0, parts=2, timeout_s=120)
    wait_until(
        lambda: ray.get(hub.status.remote()).assembling == {(MODEL, 1): (0,)},
        what="part 0 assembling",
    )
    unnamed = hub.broadcast.remote(second, version=1, part=1, parts=2, timeout_s=120)
    with pytest.raises(UnknownModelError, match="several models"):
        ray.get(unnamed, timeout=60)
    with pytest.raises(IncompleteVersionError, match=r"part 1 was refused \(UnknownModelError"):
        ray.get(named, timeout=60)
    assert ray.get(receivers[0].version.remote()) == 0


def test_a_part_that_names_no_model_fails_no_other_models_version(actors):
    """Two models sent in parts, numbered by the training step: a part of the second
    that names no model is refused as ambiguous, and the first's version at the same
    number, assembling, failed with it although that part could be none of it."""
    hub = start_hub(actors, "object_store")
    receiver = start(actors, Holder, hub, special_weights(0.0), "r-policy", MODEL)
    ready([receiver, start(actors, Holder, hub, {"v": torch.zeros(4)}, "r-value", "value")])
    first, second = split_in_parts(special_weights(2.0), 2)
    sent = [hub.broadcast.remote(first, model=MODEL, version=1, part=0, parts=2, timeout_s=120)]
    wait_until(
        lambda: ray.get(hub.status.remote()).assembling == {(MODEL, 1): (0,)},
        what="part 0 assembling",
    )
    stray = hub.broadcast.remote({"v": torch.ones(4)}, version=1, part=1, parts=2)
    with pytest.raises(UnknownModelError, match="several models"):
        ray.get(stray, timeout=60)
    sent.append(
        hub.broadcast.remote(second, model=MODEL, version=1, part=1, parts=2, timeout_s=120)
    )
    assert [r.acked for r in ray.get(sent, timeout=60)] == [("r-policy",)] * 2
    assert_bitwise(ray.get(receiver.state.remote()), special_weights(2.0))

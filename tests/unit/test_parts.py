"""A version sent in parts, without Ray: the hub's assembly checks (overlaps, keys
outside the model, parts that do not add up, mismatched calls), the whole request it
builds, and the receiver-side fetch and release of each part."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from raysync.errors import SpecMismatchError
from raysync.messages import BroadcastRequest, Update
from raysync.part_assembly import PartAssembly
from raysync.spec import WeightSpec
from raysync.transports.base import (
    ReceiverInfo,
    TransportError,
    TransportPlanner,
    TransportReceiver,
    Unplanned,
)
from raysync.transports.parts import (
    Part,
    PartedReceiver,
    Parts,
    model_of_stream,
    part_stream,
    payloads_in,
    plan_parts,
    plan_pull_parts,
)

WHOLE = {
    "a": torch.zeros(2),
    "b": torch.zeros(3, dtype=torch.float16),
    "c": torch.zeros(4, dtype=torch.int64),
    "d": torch.zeros(1),
}


def spec_of(*names: str, **changed: torch.Tensor) -> WeightSpec:
    return WeightSpec.of({n: changed.get(n, WHOLE[n]) for n in names})


def part(
    index: int, *names: str, parts: int = 2, wire: WeightSpec | None = None, **kw
) -> BroadcastRequest:
    return BroadcastRequest(
        model="m",
        version=7,
        spec=spec_of(*names),
        payloads={"object_store": f"put{index}", "shared_memory": f"slot{index}"},
        workers=kw.pop("workers", None),
        timeout_s=None,
        wait=True,
        raise_on_failure=True,
        learner_seconds=0.1 * (index + 1),
        wire_spec=wire,
        part=index,
        parts=parts,
        **kw,
    )


HUB_SPEC = WeightSpec.of(WHOLE)


def test_parts_adding_up_make_one_whole_request():
    assembly = PartAssembly("m", 7, 2, None)
    assembly.add(part(1, "b", "d"), HUB_SPEC)
    assert not assembly.complete and assembly.missing() == [0]
    assembly.add(part(0, "a", "c"), HUB_SPEC)
    assert assembly.complete
    whole = assembly.request(HUB_SPEC)
    assert whole.spec == HUB_SPEC and (whole.part, whole.parts) == (0, 1)
    assert whole.version == 7 and whole.learner_seconds == pytest.approx(0.2)
    assert whole.wire_spec is None
    assert whole.payloads["object_store"] == Parts(
        (Part("put0", spec_of("a", "c")), Part("put1", spec_of("b", "d")))
    )
    assert set(whole.payloads) == {"object_store", "shared_memory"}


def test_a_part_cast_on_the_wire_travels_in_its_own_spec():
    wire = spec_of("a", "d", a=torch.zeros(2, dtype=torch.bfloat16), d=torch.zeros(1).bfloat16())
    assembly = PartAssembly("m", 7, 2, None)
    assembly.add(part(0, "a", "d", wire=wire), HUB_SPEC)
    assembly.add(part(1, "b", "c"), HUB_SPEC)
    whole = assembly.request(HUB_SPEC)
    assert whole.spec == HUB_SPEC
    assert [t.dtype for t in whole.wire_spec.tensors] == [
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.bfloat16,
    ]
    assert whole.payloads["object_store"].parts[0].spec == wire


def test_without_a_hub_spec_the_parts_make_the_spec():
    assembly = PartAssembly("m", 7, 2, None)
    assembly.add(part(0, "c"), None)
    assembly.add(part(1, "a"), None)
    assert assembly.request(None).spec == spec_of("a", "c")


def test_overlapping_parts_are_refused_naming_the_keys():
    assembly = PartAssembly("m", 7, 2, None)
    assembly.add(part(0, "a", "b"), HUB_SPEC)
    with pytest.raises(SpecMismatchError, match=r"parts 0 and 1 .* both hold key\(s\) 'b'"):
        assembly.add(part(1, "b", "c", "d"), HUB_SPEC)


def test_parts_leaving_keys_out_are_refused_naming_them():
    assembly = PartAssembly("m", 7, 2, None)
    assembly.add(part(0, "a"), HUB_SPEC)
    assembly.add(part(1, "c"), HUB_SPEC)
    with pytest.raises(SpecMismatchError, match=r"do not add up .* missing key\(s\) 'b', 'd'"):
        assembly.request(HUB_SPEC)


def test_a_part_with_a_key_the_model_lacks_or_shapes_otherwise_is_refused():
    assembly = PartAssembly("m", 7, 2, None)
    stranger = dataclasses.replace(part(0, "a"), spec=WeightSpec.of({"zz": torch.zeros(1)}))
    with pytest.raises(
        SpecMismatchError, match=r"part 0 .* key\(s\) the model does not have: 'zz'"
    ):
        assembly.add(stranger, HUB_SPEC)
    reshaped = dataclasses.replace(part(0, "a"), spec=spec_of("a", a=torch.zeros(5)))
    with pytest.raises(SpecMismatchError, match=r"key 'a' has shape \(5,\) float32, the model"):
        assembly.add(reshaped, HUB_SPEC)


def test_a_part_that_came_before_the_model_was_known_is_checked_when_the_version_is_whole():
    """The first part came while the hub knew no spec of the model (declared, no
    receiver yet): nothing checked it. The version, whole, said the parts 'do not add
    up: missing key(s)' naming none, for a key the model does not have."""
    assembly = PartAssembly("m", 7, 2, None)
    stranger = dataclasses.replace(
        part(0, "a"), spec=WeightSpec.of({"a": WHOLE["a"], "zz": torch.zeros(1)})
    )
    assembly.add(stranger, None)
    assembly.add(part(1, "b", "c", "d"), HUB_SPEC)
    with pytest.raises(
        SpecMismatchError, match=r"part 0 .* key\(s\) the model does not have: 'zz'"
    ):
        assembly.request(HUB_SPEC)


@pytest.mark.parametrize(
    "second, message",
    [
        (part(1, "b", parts=3), "says the version has 3 parts; an earlier part said 2"),
        (part(0, "b"), "part 0 of version 7 .* arrived twice"),
        (part(1, "b", workers=("w1",)), "every part of a version goes to the same receivers"),
    ],
)
def test_parts_that_disagree_with_the_first_are_refused(second, message):
    assembly = PartAssembly("m", 7, 2, None)
    assembly.add(part(0, "a"), HUB_SPEC)
    with pytest.raises(ValueError, match=message):
        assembly.add(second, HUB_SPEC)


def test_parts_may_list_the_same_workers_in_any_order():
    """Ranks that build ``workers`` from a set list them in their own order."""
    assembly = PartAssembly("m", 7, 2, ("w1", "w2"))
    assembly.add(part(0, "a", "b", workers=("w1", "w2")), HUB_SPEC)
    assembly.add(part(1, "c", "d", workers=("w2", "w1")), HUB_SPEC)
    assert assembly.complete and assembly.request(HUB_SPEC).workers == ("w1", "w2")


def test_hand_offs_not_every_part_carries_are_left_out_and_named_unread():
    """Ranks whose routes differ (a receiver of a new transport joined between their
    broadcasts): the version goes by the hand-offs every part carries; the others'
    payloads are nobody's to read."""
    assembly = PartAssembly("m", 7, 2, None)
    assembly.add(part(0, "a", "b"), HUB_SPEC)
    assembly.add(
        dataclasses.replace(part(1, "c", "d"), payloads={"object_store": "put1"}), HUB_SPEC
    )
    assert set(assembly.request(HUB_SPEC).payloads) == {"object_store"}
    assert assembly.unread_payloads() == ["slot0"]


# -- the receiver's side -------------------------------------------------------------
class _Staging(TransportReceiver):
    """Stages each payload as tensors filled with its number; records releases."""

    def __init__(self, failing: str | None = None) -> None:
        self.failing = failing
        self.released: list[tuple[str, list[float] | None]] = []
        self.leased: dict[str, list[torch.Tensor]] = {}  #: payload -> what fetch returned

    def fetch(self, payload, spec):
        if payload == self.failing:
            raise RuntimeError(f"{payload} is gone")
        staged = [torch.full(t.shape, float(payload[-1]), dtype=t.dtype) for t in spec.tensors]
        self.leased[payload] = staged
        return staged

    def release(self, payload, staged):
        # Released with the very sequence fetch returned (nixl's pool knows leases by it).
        assert staged is None or staged is self.leased[payload]
        values = None if staged is None else [float(t.reshape(-1)[0]) for t in staged if t.numel()]
        self.released.append((payload, values))


PARTED = Parts((Part("put1", spec_of("b", "d")), Part("put2", spec_of("a", "c"))))


def test_each_part_is_fetched_and_staged_in_spec_order():
    inner = _Staging()
    staged = PartedReceiver(inner).fetch(PARTED, HUB_SPEC)
    assert [float(t[0]) for t in staged] == [2.0, 1.0, 2.0, 1.0]  # a, b, c, d
    assert [t.dtype for t in staged] == [torch.float32, torch.float16, torch.int64, torch.float32]
    receiver = PartedReceiver(inner)
    staged = receiver.fetch(PARTED, HUB_SPEC)
    receiver.release(PARTED, staged)
    assert inner.released == [("put1", [1.0, 1.0]), ("put2", [2.0, 2.0])]
    receiver.release(PARTED, None)  # skipped: each part released without staged data
    assert inner.released[2:] == [("put1", None), ("put2", None)]


def test_a_part_that_fails_releases_every_part_once():
    """The receiver's core releases what a failed fetch held (no staged data): the
    parts, released by the failed fetch already, are not released again (a second
    release of a shared-memory part freed its slot under another fetch of it)."""
    inner = _Staging(failing="put2")
    receiver = PartedReceiver(inner)
    with pytest.raises(RuntimeError, match="put2 is gone"):
        receiver.fetch(PARTED, HUB_SPEC)
    assert inner.released == [("put1", [1.0, 1.0]), ("put2", None)]
    receiver.release(PARTED, None)  # as the core does after a failed fetch
    assert inner.released == [("put1", [1.0, 1.0]), ("put2", None)]
    receiver.release(PARTED, None)  # a release of the version, not of that fetch
    assert inner.released[2:] == [("put1", None), ("put2", None)]


def test_a_whole_payload_passes_through():
    inner = _Staging()
    staged = PartedReceiver(inner).fetch("put3", spec_of("a"))
    assert float(staged[0][0]) == 3.0
    PartedReceiver(inner).release("put3", None)
    assert inner.released == [("put3", None)]


def test_a_version_in_parts_is_intact_only_while_every_part_is():
    class Rewriting(_Staging):
        def check_intact(self, payload):
            if payload == "put2":
                raise TransportError(f"{payload}'s slot was rewritten")

    receiver = PartedReceiver(Rewriting())
    receiver.check_intact("put1")  # a whole payload: its own
    with pytest.raises(TransportError, match="put2's slot was rewritten"):
        receiver.check_intact(PARTED)


# -- the hub's planning ---------------------------------------------------------------
class _Planner(TransportPlanner):
    def __init__(self) -> None:
        self.planned: list[tuple[str, str, tuple[str, ...]]] = []

    async def plan(self, update, spec, targets):
        self.planned.append((update.model, update.payload, spec.names))
        return {t.worker: f"{update.payload}@{t.worker}" for t in targets}

    async def plan_pull(self, update, spec, receiver):
        return f"{update.payload}>{receiver.worker}"


TARGETS = [ReceiverInfo(w, f"A({w})", "node", "proc", None) for w in ("w0", "w1")]
UPDATE = Update("m", 7, HUB_SPEC.digest, "object_store", PARTED)


def test_the_hub_plans_each_part_as_a_stream_of_its_own():
    planner = _Planner()
    planned = asyncio.run(plan_parts(planner, UPDATE, HUB_SPEC, TARGETS, in_one_plan=False))
    assert sorted(planner.planned) == [
        (part_stream("m", 0, 2), "put1", ("b", "d")),
        (part_stream("m", 1, 2), "put2", ("a", "c")),
    ]
    assert planned["w1"] == Parts(
        (Part("put1@w1", spec_of("b", "d")), Part("put2@w1", spec_of("a", "c")))
    )
    pulled = asyncio.run(plan_pull_parts(planner, UPDATE, HUB_SPEC, TARGETS[0], in_one_plan=False))
    assert [p.payload for p in pulled.parts] == ["put1>w0", "put2>w0"]


def test_a_worker_one_part_was_not_planned_for_gets_no_payload():
    """It left the hub while the parts were planned (rpc leaves it out of the next part's
    plan): it gets nothing, which the hub reports as its failure alone."""

    class _LeftAfterFirstPart(_Planner):
        async def plan(self, update, spec, targets):
            planned = await super().plan(update, spec, targets)
            if len(self.planned) > 1:
                del planned["w0"]
            return planned

    planned = asyncio.run(
        plan_parts(_LeftAfterFirstPart(), UPDATE, HUB_SPEC, TARGETS, in_one_plan=False)
    )
    assert list(planned) == ["w1"]


def test_a_worker_one_part_could_not_be_planned_for_lets_the_others_go_and_says_why():
    """Its node's relay of the second part failed: it gets that part's Unplanned beside
    the first part's payload (left out, the first part's hold, a shared-memory slot,
    stayed taken for a worker that never read it); its receiver lets the first part
    go and fails naming the part and why. The other worker gets its parts."""
    why = Unplanned("the relay to its node failed")

    class _SecondPartUnplannedForW0(_Planner):
        async def plan(self, update, spec, targets):
            planned = await super().plan(update, spec, targets)
            if update.payload == "put2":
                planned["w0"] = why
            return planned

    planned = asyncio.run(
        plan_parts(_SecondPartUnplannedForW0(), UPDATE, HUB_SPEC, TARGETS, in_one_plan=False)
    )
    assert [p.payload for p in planned["w0"].parts] == ["put1@w0", why]
    assert [p.payload for p in planned["w1"].parts] == ["put1@w1", "put2@w1"]
    inner = _Staging()
    receiver = PartedReceiver(inner)
    with pytest.raises(TransportError) as raised:
        receiver.fetch(planned["w0"], HUB_SPEC)
    assert str(raised.value) == (
        "part 1 of 2 of the version was not planned for this receiver: the relay to its node failed"
    )
    assert inner.released == [("put1@w0", None)]
    receiver.release(planned["w0"], None)  # as the core does after a failed fetch
    assert inner.released == [("put1@w0", None)]


def test_a_part_whose_plan_raised_does_not_lose_the_others_plans():
    """One part's plan raised (its owner was lost): the other part's plan, which placed
    holds, still reaches each worker, to be let go; a worker no part was planned for
    gets the first reason, and a pull of such a version says it."""

    class _SecondPartRaises(_Planner):
        async def plan(self, update, spec, targets):
            if update.payload == "put2":
                raise TransportError("lost with its owner")
            return await super().plan(update, spec, targets)

        async def plan_pull(self, update, spec, receiver):
            if update.payload == "put2":
                raise TransportError("lost with its owner")
            return await super().plan_pull(update, spec, receiver)

    planned = asyncio.run(
        plan_parts(_SecondPartRaises(), UPDATE, HUB_SPEC, TARGETS, in_one_plan=False)
    )
    for worker in ("w0", "w1"):
        first, second = (p.payload for p in planned[worker].parts)
        assert first == f"put1@{worker}"
        assert second == Unplanned(
            "part 1 of 2 could not be planned: TransportError('lost with its owner')"
        )
    pulled = asyncio.run(
        plan_pull_parts(_SecondPartRaises(), UPDATE, HUB_SPEC, TARGETS[0], in_one_plan=False)
    )
    assert [p.payload for p in pulled.parts] == [
        "put1>w0",
        Unplanned("part 1 of 2 could not be planned: TransportError('lost with its owner')"),
    ]

    class _EveryPartUnplanned(_Planner):
        async def plan(self, update, spec, targets):
            return {t.worker: Unplanned(f"no node for {update.payload}") for t in targets}

    planned = asyncio.run(
        plan_parts(_EveryPartUnplanned(), UPDATE, HUB_SPEC, TARGETS, in_one_plan=False)
    )
    assert planned == dict.fromkeys(("w0", "w1"), Unplanned("no node for put1"))


def test_a_transport_planning_parts_in_one_plan_gets_the_whole_update():
    planner = _Planner()
    planned = asyncio.run(plan_parts(planner, UPDATE, HUB_SPEC, TARGETS, in_one_plan=True))
    assert planner.planned == [("m", PARTED, HUB_SPEC.names)]
    assert planned == {"w0": f"{PARTED}@w0", "w1": f"{PARTED}@w1"}


def test_kept_payloads_are_listed_part_by_part():
    assert payloads_in(("x", PARTED)) == ("x", "put1", "put2")


def test_a_part_streams_name_leads_back_to_its_model():
    assert model_of_stream(part_stream("policy", 1, 4)) == "policy"
    assert model_of_stream("policy") == "policy"
    # A model id that looks like a part's name itself is one part deeper.
    assert model_of_stream(part_stream("m[part 0 of 2]", 0, 3)) == "m[part 0 of 2]"

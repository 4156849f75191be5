"""The hub's assemblies of versions sent in parts, on an event loop without Ray: every
part gets the same start once the last arrives, and every part — waiting or late —
hears why a version failed (a refused part, the deadline, the hub closing)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
import weakref

import pytest
import torch

from raysync.actors import hub_parts
from raysync.actors.hub_parts import Assemblies
from raysync.errors import IncompleteVersionError, SpecMismatchError, StaleVersionError
from raysync.messages import BroadcastRequest
from raysync.spec import WeightSpec

WHOLE = {"a": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(4, dtype=torch.int64)}
KNOWN = WeightSpec.of(WHOLE)
now = time.perf_counter  #: a part's arrival, on the hub's clock
FIRST = now()  #: the first part's arrival in a test that checks it is passed on


def part(index: int, *names: str, version: int = 7, parts: int = 2) -> BroadcastRequest:
    return BroadcastRequest(
        model="m",
        version=version,
        spec=WeightSpec.of({n: WHOLE[n] for n in names}),
        payloads={"object_store": f"put{index}"},
        workers=None,
        timeout_s=None,
        wait=True,
        raise_on_failure=True,
        learner_seconds=0.1,
        part=index,
        parts=parts,
    )


class Starts:
    """The hub's start of a whole version, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[BroadcastRequest, float, float]] = []

    async def __call__(self, whole: BroadcastRequest, timeout_s: float, first: float) -> str:
        self.calls.append((whole, timeout_s, first))
        return f"started v{whole.version}"


def test_every_part_gets_the_one_start_once_the_last_arrives():
    async def run():
        starts = Starts()
        assemblies = Assemblies(starts)
        first = asyncio.ensure_future(assemblies.take(part(0, "a"), "m", KNOWN, 30, FIRST))
        await asyncio.sleep(0)  # the first part is in, waiting for the second
        assert not first.done() and assemblies.arrived() == {("m", 7): (0,)}
        second = await assemblies.take(part(1, "b", "c"), "m", KNOWN, 30, FIRST + 1)
        return starts, second, await first, assemblies

    starts, second, first, assemblies = asyncio.run(run())
    assert first == second == "started v7"
    [(whole, timeout_s, first_arrived)] = starts.calls
    assert whole.spec == KNOWN and (whole.part, whole.parts) == (0, 1)  # one version now
    [parts] = whole.payloads.values()
    assert [p.payload for p in parts.parts] == ["put0", "put1"]
    assert (timeout_s, first_arrived) == (30, FIRST)  # the deadline runs from the first part
    assert ("m", 7) not in assemblies and assemblies.arrived() == {}


def test_a_part_with_another_timeout_is_refused_naming_both():
    """The first part's timeout is the deadline for the others and then the whole
    version's: a part that says another would have one or the other ignored,
    depending on which rank came first."""

    async def run():
        assemblies = Assemblies(Starts())
        waiting = asyncio.ensure_future(assemblies.take(part(0, "a"), "m", KNOWN, 30, now()))
        await asyncio.sleep(0)
        with pytest.raises(ValueError) as refused:
            await assemblies.take(part(1, "b", "c"), "m", KNOWN, 5, now())
        with pytest.raises(IncompleteVersionError, match="part 1 was refused"):
            await waiting
        return str(refused.value)

    assert asyncio.run(run()) == (
        "part 1 of version 7 of model 'm' (2 parts) has a timeout of 5 s, an earlier part "
        "30 s: "
        "every part of a version has the same timeout_s"
    )


def test_a_refused_part_fails_the_version_for_the_parts_waiting_and_to_come():
    async def run():
        assemblies = Assemblies(Starts())
        waiting = asyncio.ensure_future(
            assemblies.take(part(0, "a", parts=3), "m", KNOWN, 30, now())
        )
        await asyncio.sleep(0)
        with pytest.raises(SpecMismatchError, match="'a'"):  # a is part 0's already
            await assemblies.take(part(1, "a", parts=3), "m", KNOWN, 30, now())
        with pytest.raises(IncompleteVersionError, match="part 1 was refused"):
            await waiting
        assert ("m", 7) in assemblies and assemblies.arrived() == {}
        with pytest.raises(IncompleteVersionError, match="arrived after the version failed"):
            await assemblies.take(part(2, "c", parts=3), "m", KNOWN, 30, now())

    asyncio.run(run())


def test_a_failed_version_sent_again_assembles_anew():
    """A version number whose attempt failed is not used up: every part is sent once
    per attempt, so a part the failed attempt heard already begins the next one (its
    learner retries), and the version is started from the new attempt's parts alone."""

    async def run():
        starts = Starts()
        assemblies = Assemblies(starts)
        with pytest.raises(IncompleteVersionError, match=r"part\(s\) 1 did not arrive"):
            await assemblies.take(part(0, "a"), "m", KNOWN, 0.01, now())
        assert not assemblies.begins_attempt("m", part(1, "b", "c"))  # the late one
        assert assemblies.begins_attempt("m", part(0, "a"))  # its learner sending again
        assert assemblies.begins_attempt("m", part(1, "b", parts=3))  # in three parts now
        again = asyncio.ensure_future(assemblies.take(part(0, "a"), "m", KNOWN, 30, now()))
        await asyncio.sleep(0)
        assert assemblies.arrived() == {("m", 7): (0,)}
        second = await assemblies.take(part(1, "b", "c"), "m", KNOWN, 30, now())
        return starts, await again, second

    starts, first, second = asyncio.run(run())
    assert first == second == "started v7"
    [(whole, timeout_s, _)] = starts.calls
    assert whole.spec == KNOWN and timeout_s == 30  # the new attempt's, not the failed one's


def test_a_late_part_hears_why_and_then_the_version_can_be_sent_again():
    """The part a failed attempt missed, arriving late, is that attempt's: it hears why
    the version failed and how to send it again. Every part heard, the next part of
    that number begins a new attempt, whichever it is."""

    async def run():
        assemblies = Assemblies(Starts())
        with pytest.raises(IncompleteVersionError, match=r"part\(s\) 1 did not arrive"):
            await assemblies.take(part(0, "a"), "m", KNOWN, 0.01, now())
        with pytest.raises(IncompleteVersionError) as late:
            await assemblies.take(part(1, "b", "c"), "m", KNOWN, 30, now())
        assert ("m", 7) not in assemblies
        again = asyncio.ensure_future(assemblies.take(part(1, "b", "c"), "m", KNOWN, 30, now()))
        await asyncio.sleep(0)
        assert assemblies.arrived() == {("m", 7): (1,)}
        started = await assemblies.take(part(0, "a"), "m", KNOWN, 30, now())
        return str(late.value), started, await again

    late, started, again = asyncio.run(run())
    assert "part 1 of version 7 of model 'm' (2 parts) arrived after the version failed" in late
    assert "did not arrive within 0.01 s" in late and "send every part again" in late
    assert started == again == "started v7"


def test_a_late_part_of_a_failed_attempt_does_not_fail_the_attempt_sent_again():
    """Rank 0 sends the version again, with a longer timeout, after the first attempt
    timed out; rank 1's part of the first attempt arrives only then. It was checked
    against the new attempt (another timeout) and failed it for everyone; it is the
    failed attempt's, and hears why that one failed."""

    async def run():
        starts = Starts()
        assemblies = Assemblies(starts)
        with pytest.raises(IncompleteVersionError, match=r"part\(s\) 1 did not arrive"):
            await assemblies.take(part(0, "a"), "m", KNOWN, 0.01, now())
        again = asyncio.ensure_future(assemblies.take(part(0, "a"), "m", KNOWN, 30, now()))
        await asyncio.sleep(0)
        with pytest.raises(IncompleteVersionError, match="arrived after the version failed"):
            await assemblies.take(part(1, "b", "c"), "m", KNOWN, 0.01, now())
        assert not again.done() and assemblies.arrived() == {("m", 7): (0,)}
        second = await assemblies.take(part(1, "b", "c"), "m", KNOWN, 30, now())
        return starts, await again, second

    starts, first, second = asyncio.run(run())
    assert first == second == "started v7"
    [(_, timeout_s, _)] = starts.calls
    assert timeout_s == 30


@pytest.mark.parametrize("first_to_come", ["refused", "taken"])
def test_a_part_refused_before_it_is_taken_fails_the_version_at_once(first_to_come):
    """A part the hub refuses before taking it (its learner's own check: a version it
    delivered itself): the other parts, waiting or to come, fail at once saying so
    (they waited out the deadline, told the part never came)."""
    refusal = StaleVersionError("version 7 is at or below version 9, which its learner sent")

    async def run():
        assemblies = Assemblies(Starts())
        waiting = None
        if first_to_come == "taken":
            waiting = asyncio.ensure_future(assemblies.take(part(0, "a"), "m", KNOWN, 30, now()))
            await asyncio.sleep(0)
        assemblies.refuse(part(1, "b", "c"), "m", refusal)
        if waiting is None:
            waiting = asyncio.ensure_future(assemblies.take(part(0, "a"), "m", KNOWN, 30, now()))
        with pytest.raises(IncompleteVersionError) as failed:
            await asyncio.wait_for(waiting, 5)
        return str(failed.value)

    reason = asyncio.run(run())
    assert "part 1 was refused (StaleVersionError: version 7 is at or below" in reason


def test_payloads_the_whole_leaves_out_are_named_unread_as_it_starts():
    async def run():
        unread: list[list[object]] = []
        assemblies = Assemblies(Starts(), unread.append)
        carrying_two = dataclasses.replace(
            part(0, "a"), payloads={"object_store": "put0", "nixl": "ring0"}
        )
        first = asyncio.ensure_future(assemblies.take(carrying_two, "m", KNOWN, 30, now()))
        await asyncio.sleep(0)
        assert unread == []
        await assemblies.take(part(1, "b", "c"), "m", KNOWN, 30, now())
        await first
        return unread

    assert asyncio.run(run()) == [["ring0"]]


class RefusingStarts(Starts):
    """The hub refuses the whole version (a stale number, say) as it starts it."""

    async def __call__(self, whole: BroadcastRequest, timeout_s: float, first: float) -> str:
        raise ValueError("version 7 is not above the current version 9")


def test_a_whole_refused_as_it_starts_blames_no_part():
    async def run():
        assemblies = Assemblies(RefusingStarts())
        waiting = asyncio.ensure_future(assemblies.take(part(0, "a"), "m", KNOWN, 30, now()))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="not above the current version"):
            await assemblies.take(part(1, "b", "c"), "m", KNOWN, 30, now())
        with pytest.raises(
            IncompleteVersionError,
            match=r"failed: the whole was refused \(ValueError: version 7 is not above",
        ):
            await waiting

    asyncio.run(run())


def test_a_part_missing_at_the_deadline_is_named_and_fails_the_version():
    async def run():
        assemblies = Assemblies(Starts())
        with pytest.raises(IncompleteVersionError, match=r"part\(s\) 1 did not arrive within"):
            await assemblies.take(part(0, "a"), "m", KNOWN, 0.01, now())

    asyncio.run(run())


def test_closing_fails_every_version_still_assembling():
    async def run():
        starts = Starts()
        assemblies = Assemblies(starts)
        waiting = [
            asyncio.ensure_future(assemblies.take(part(0, "a", version=v), "m", KNOWN, 30, now()))
            for v in (7, 8)
        ]
        await asyncio.sleep(0)
        assert assemblies.arrived() == {("m", 7): (0,), ("m", 8): (0,)}
        assemblies.fail_all("the hub is shutting down")
        for task in waiting:
            with pytest.raises(IncompleteVersionError, match="the hub is shutting down"):
                await task
        assert starts.calls == [] and assemblies.arrived() == {}

    asyncio.run(run())


def test_only_the_newest_failed_versions_are_kept(monkeypatch):
    monkeypatch.setattr(hub_parts, "FAILED_KEPT", 2)

    async def run():
        assemblies = Assemblies(Starts())
        for version in (1, 2, 3):
            task = asyncio.ensure_future(
                assemblies.take(part(0, "a", version=version), "m", KNOWN, 30, now())
            )
            await asyncio.sleep(0)
            assemblies.fail(("m", version), "refused")
            with pytest.raises(IncompleteVersionError):
                await task
        return [("m", v) in assemblies for v in (1, 2, 3)]

    assert asyncio.run(run()) == [False, True, True]


def test_a_failed_version_lets_go_of_the_parts_that_arrived():
    """Their payloads are the learners' data in the object store: a version kept only to
    tell late parts why it failed must not keep them."""

    class Payload:
        pass

    async def run():
        assemblies = Assemblies(Starts())
        request = part(0, "a")
        payload = Payload()
        request = dataclasses.replace(request, payloads={"object_store": payload})
        waiting = asyncio.ensure_future(assemblies.take(request, "m", KNOWN, 0.01, now()))
        with pytest.raises(IncompleteVersionError, match="did not arrive"):
            await waiting
        return assemblies, weakref.ref(payload)

    assemblies, gone = asyncio.run(run())
    gc.collect()
    assert ("m", 7) in assemblies  # kept, to tell late parts why
    assert gone() is None


def test_a_first_part_that_waited_before_it_was_taken_keeps_the_deadline_of_its_arrival():
    """A first part waits before the assemblies take it (for the hub's first model, for
    its turn): its deadline ran from when it was taken, so a missing part was named
    up to twice the timeout after the first arrived."""

    async def run():
        assemblies = Assemblies(Starts())
        taken = now()
        with pytest.raises(IncompleteVersionError, match=r"part\(s\) 1 did not arrive within"):
            await assemblies.take(part(0, "a"), "m", KNOWN, 30, now() - 29.9)
        return now() - taken

    assert asyncio.run(run()) < 15  # failed at its arrival's deadline, not 30 s after


def test_parts_that_name_no_model_are_of_the_one_their_first_part_went_to():
    """The hub resolves a part that names no model to the only one registered; a model
    registered before the next part would make that one ambiguous (refused alone, while
    the first waited out the deadline). The next parts of the version go where the
    first went, until it starts; a version whose first part named its model, or a
    version started, gives unnamed parts no model."""

    async def run():
        assemblies = Assemblies(Starts())
        unnamed = [
            dataclasses.replace(part(i, *names), model=None)
            for i, names in enumerate([("a",), ("b", "c")])
        ]
        first = asyncio.ensure_future(assemblies.take(unnamed[0], "m", KNOWN, 30, FIRST))
        named = asyncio.ensure_future(
            assemblies.take(part(0, "a", version=8), "n", KNOWN, 30, FIRST)
        )
        await asyncio.sleep(0)
        found = (assemblies.model_of_unnamed(7, 1), assemblies.model_of_unnamed(8, 1))
        await assemblies.take(unnamed[1], found[0], KNOWN, 30, FIRST + 1)
        await first
        named.cancel()
        return found, assemblies.model_of_unnamed(7, 1)

    (during, named), after = asyncio.run(run())
    assert (during, named, after) == ("m", None, None)


def test_a_part_that_names_no_model_fits_only_versions_it_could_be_a_part_of():
    """Refused for naming no model among several, a part fails the version assembling
    at its number that it could be a part of. Any other model's at that number failed
    too (two models sent in parts, both numbered by the training step): one learner's
    slip cost another model its version."""

    async def run():
        assemblies = Assemblies(Starts())
        waiting = asyncio.ensure_future(assemblies.take(part(0, "a"), "m", KNOWN, 30, FIRST))
        await asyncio.sleep(0)  # part 0 of version 7 of "m" is in
        spec_of = {"m": KNOWN}.get
        unnamed = [
            dataclasses.replace(p, model=None)
            for p in (
                part(1, "b", "c"),  # fits
                part(0, "b"),  # part 0 arrived already
                part(1, "a"),  # key a is part 0's
                part(1, "b", parts=3),  # another number of parts
                part(1, "b", version=8),  # another version
                dataclasses.replace(part(1, "b"), spec=WeightSpec.of({"v": torch.zeros(5)})),
            )
        ]
        found = [assemblies.fitting(p, spec_of) for p in unnamed]
        waiting.cancel()
        return found

    assert asyncio.run(run()) == [["m"], [], [], [], [], []]


def test_a_late_part_that_names_no_model_is_of_the_failed_attempt_that_named_none():
    """The first attempt's parts named no model; it failed, and another model registered
    before its late part came: that part was told to name its model, not why its
    version failed (and the attempt, never hearing it, was kept)."""

    async def run():
        assemblies = Assemblies(Starts())
        unnamed = [
            dataclasses.replace(part(i, *names), model=None)
            for i, names in enumerate([("a",), ("b", "c")])
        ]
        with pytest.raises(IncompleteVersionError, match=r"part\(s\) 1 did not arrive"):
            await assemblies.take(unnamed[0], "m", KNOWN, 0.01, now())
        return assemblies.model_of_unnamed(7, 1), assemblies.model_of_unnamed(7, 0)

    assert asyncio.run(run()) == ("m", None)  # part 0 was heard: it begins an attempt

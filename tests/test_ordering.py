"""InOrder and ThreadsInOrder: numbered sections of an async or threaded actor run in
their callers' order."""

from __future__ import annotations

import asyncio
import threading

import pytest

from raysync.ordering import InOrder, ThreadsInOrder
from tests.helpers import wait_until


def _run(gate: InOrder, calls: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Start one section per (stream, number) in the given order; the order they ran."""
    ran: list[tuple[str, int]] = []

    async def section(stream: str, number: int) -> None:
        await gate.wait_turn(stream, number)
        ran.append((stream, number))

    async def main() -> None:
        await asyncio.gather(*(section(s, n) for s, n in calls))

    asyncio.run(main())
    return ran


def test_sections_run_in_number_order_whatever_order_they_start_in():
    calls = [("learner", n) for n in (3, 1, 4, 2, 5)]
    assert _run(InOrder(wait_s=30), calls) == [("learner", n) for n in range(1, 6)]


def test_streams_are_independent_and_a_missing_number_is_skipped_after_the_wait():
    # "a" never sends 1: its sections wait (0.2 s), while "b" and unnumbered ones go on.
    ran = _run(InOrder(wait_s=0.2), [("a", 3), ("a", 2), ("b", 1), ("c", 0), ("b", 2)])
    assert sorted(ran[:3]) == [("b", 1), ("b", 2), ("c", 0)]
    assert ran.index(("b", 1)) < ran.index(("b", 2))
    assert ran[3:] == [("a", 2), ("a", 3)]


def test_numbers_below_the_callers_floor_are_not_waited_for():
    # A learner whose broadcasts 1..6 went to an earlier incarnation of the hub sends 8
    # and 7, saying everything below 7 is done with: both run at once, in order.
    gate = InOrder(wait_s=30)
    ran: list[int] = []

    async def section(number: int) -> None:
        await gate.wait_turn("learner", number, floor=7)
        ran.append(number)

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(section(8), section(7)), timeout=5)

    asyncio.run(main())
    assert ran == [7, 8]


def test_a_reader_started_before_a_call_sees_what_that_call_changed():
    # The hub's route (the reader) may start before the submit it follows: it waits for
    # that submit's turn and reads the version the submit booked, not the one before.
    gate = InOrder(wait_s=30)
    booked = {"version": 0}
    read: list[int] = []

    async def submit(number: int, version: int) -> None:
        await gate.wait_turn("learner", number)
        booked["version"] = version

    async def route(after: int) -> None:
        await gate.wait_passed("learner", after)
        read.append(booked["version"])

    async def main() -> None:
        await asyncio.wait_for(
            asyncio.gather(route(2), route(0), submit(2, 10), submit(1, 3)), timeout=5
        )

    asyncio.run(main())
    assert read == [0, 10]


def test_a_reader_of_a_call_that_had_its_turn_goes_on_without_awaiting():
    # The hub's forget_learner (the reader) must act before a call started after it
    # runs: with one await in between, the learner's next side was routed a number
    # past the one the forgotten learner held, and its versions skipped one.
    gate = InOrder(wait_s=30)

    async def main() -> None:
        await gate.wait_turn("learner", 1)
        for reader in (gate.wait_passed("learner", 1), gate.wait_passed("learner", 0)):
            with pytest.raises(StopIteration) as returned:
                reader.send(None)  # runs to its end at once, or yields: not StopIteration
            assert returned.value.value is True

    asyncio.run(main())


def test_a_reader_of_a_lost_call_reads_without_it_after_the_wait():
    gate = InOrder(wait_s=0.2)
    read: list[str] = []

    async def route() -> None:
        await gate.wait_passed("learner", 1)  # call 1 never comes
        read.append("read")

    asyncio.run(asyncio.wait_for(route(), timeout=5))
    assert read == ["read"]


def _run_threads(gate: ThreadsInOrder, calls: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """:func:`_run` for a threaded actor: one thread per section, started in the given
    order, each one started once the one before waits for its turn (or ran)."""
    ran: list[tuple[str, int]] = []
    threads = []
    for stream, number in calls:

        def section(stream: str = stream, number: int = number) -> None:
            with gate.turn(stream, number):
                ran.append((stream, number))

        thread = threading.Thread(target=section)
        thread.start()
        threads.append(thread)
        _wait_until_waiting_or_ran(gate, stream, number, ran, thread)
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
    return ran


def _wait_until_waiting_or_ran(
    gate: ThreadsInOrder, stream: str, number: int, ran: list, thread: threading.Thread
) -> None:
    """Return once ``thread``'s section of call ``number`` waits for its turn, or ran."""

    def settled() -> bool:
        with gate.lock:  # entering and waiting happen under it: seen whole or not at all
            waiting = gate._turns._waiting.get(stream, set())
            return (stream, number) in ran or number in waiting or not thread.is_alive()

    wait_until(settled, timeout_s=10, what=f"call {number} of {stream!r} coming in")


def test_threads_run_their_sections_in_number_order():
    calls = [("learner", n) for n in (3, 1, 4, 2, 5)]
    assert _run_threads(ThreadsInOrder(wait_s=30), calls) == [("learner", n) for n in range(1, 6)]


def test_threads_skip_a_missing_number_after_the_wait_and_a_raising_section_passes_its_turn():
    gate = ThreadsInOrder(wait_s=0.2)
    try:
        with gate.turn("a", 1):
            raise ValueError("the section failed")
    except ValueError:
        pass
    # 1 had its turn although it raised: 2 goes on at once; 4 waits for the missing 3.
    ran = _run_threads(gate, [("a", 4), ("a", 2), ("b", 0)])
    assert sorted(ran[:2]) == [("a", 2), ("b", 0)]
    assert ran[2:] == [("a", 4)]


def test_idle_streams_beyond_those_kept_are_forgotten_and_start_again_from_their_floor():
    # A learner that calls release() every step numbers its broadcasts in a new stream
    # each time: the hub keeps books for the streams used last, not for every one.
    gate = InOrder(wait_s=30, streams_kept=3)

    async def main() -> None:
        for step in range(10):
            await asyncio.wait_for(gate.wait_turn(f"learner-{step}", 1, floor=1), timeout=5)
        assert gate.streams() == 3
        # The first stream, forgotten, sends its next call with its floor: no wait.
        await asyncio.wait_for(gate.wait_turn("learner-0", 2, floor=2), timeout=5)
        assert gate.streams() == 3

    asyncio.run(main())


def test_a_stream_with_a_call_waiting_is_never_forgotten():
    # "slow" waits for its number 1 while many other streams come and go: its books stay,
    # and its number 1 arriving lets number 2 run, in order.
    gate = InOrder(wait_s=30, streams_kept=1)
    ran: list[int] = []

    async def section(number: int) -> None:
        await gate.wait_turn("slow", number)
        ran.append(number)

    async def main() -> None:
        second = asyncio.ensure_future(section(2))
        await asyncio.sleep(0)  # let it enter and wait
        for step in range(5):
            await gate.wait_turn(f"other-{step}", 1)
        assert gate.streams() == 2  # "slow" (waiting) and the last other
        await asyncio.wait_for(asyncio.gather(section(1), second), timeout=5)

    asyncio.run(main())
    assert ran == [1, 2]


def test_a_call_that_comes_after_later_ones_went_on_without_it_is_told_it_is_late():
    """A learner's broadcast 1 reaching the hub after broadcast 2 was versioned without
    it (the wait for 1 gave up): the hub must not publish its older weights over 2's."""
    gate = InOrder(wait_s=0.1)

    async def main() -> list[bool]:
        second = await gate.wait_turn("learner", 2)  # 1 has not come: 2 goes on after 0.1 s
        first = await gate.wait_turn("learner", 1)
        third = await gate.wait_turn("learner", 3)
        unnumbered = await gate.wait_turn("learner", 0)
        return [second, first, third, unnumbered]

    assert asyncio.run(main()) == [False, True, False, False]

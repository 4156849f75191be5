"""InOrder: numbered sections of an async actor run in their callers' order."""

from __future__ import annotations

import asyncio

from raysync.ordering import InOrder


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

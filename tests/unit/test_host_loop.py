"""call_on_host_loop (raysync/host_loop.py) without Ray: a receiver's write handed to an
async host's event loop from a delivering thread, run exactly once, on the loop or, if
the loop never runs it, on the calling thread; on the calling thread standing in for the
loop while a synchronous method holds the loop's thread."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from raysync.host_loop import (
    call_on_host_loop,
    holding_its_loop,
    read_off_loop,
    standing_in_for_a_loop,
)


class _Call:
    """A write that records the thread of each run, and whether it stood in for a loop
    there, and returns ``result``."""

    def __init__(self, result: object = "applied") -> None:
        self.result = result
        self.threads: list[int] = []
        self.standing_in: list[bool] = []

    def __call__(self) -> object:
        self.threads.append(threading.get_ident())
        self.standing_in.append(standing_in_for_a_loop())
        return self.result


@pytest.fixture
def handed(monkeypatch) -> threading.Event:
    """Set once a call has been handed to a loop."""
    event = threading.Event()
    real_hand_over = asyncio.run_coroutine_threadsafe

    def hand_over(coroutine, to):  # type: ignore[no-untyped-def]
        future = real_hand_over(coroutine, to)
        event.set()
        return future

    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", hand_over)
    return event


def _call_in_a_thread(loop: asyncio.AbstractEventLoop, call: Callable[[], object]) -> list[object]:
    """What ``call_on_host_loop`` returned or raised, from a thread of its own (as Ray
    runs a delivery)."""
    outcome: list[object] = []

    def calling() -> None:
        try:
            outcome.append(call_on_host_loop(loop, call))
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=calling, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the call waited for a loop that never ran it"
    return outcome


def _run_once_from_a_thread(
    loop: Callable[[], asyncio.AbstractEventLoop], looping: threading.Thread, busy: threading.Event
) -> _Call:
    """Start ``looping`` (the host's loop, ``busy`` once it is), hand it a call from
    another thread: the call ran once and its result came back."""
    call = _Call()
    looping.start()
    try:
        assert busy.wait(30)
        assert _call_in_a_thread(loop(), call) == ["applied"]
    finally:
        looping.join(30)
    assert len(call.threads) == 1
    return call


def test_a_call_runs_on_the_running_loop_and_its_error_is_raised_in_the_caller():
    loop = asyncio.new_event_loop()
    looping = threading.Thread(target=loop.run_forever, daemon=True)
    looping.start()
    try:
        call = _Call()
        assert _call_in_a_thread(loop, call) == ["applied"]
        assert call.threads == [looping.ident]

        def failing() -> None:
            raise ValueError("the write failed")

        [raised] = _call_in_a_thread(loop, failing)
        assert isinstance(raised, ValueError) and "the write failed" in str(raised)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        looping.join(30)
        loop.close()


def test_a_call_is_run_here_without_a_loop_on_the_loop_itself_or_when_it_has_ended():
    """A sync host whose method read the model inside its own ``asyncio.run``: the gate
    saw that loop, which has ended since; the call is not handed to it."""
    call = _Call()
    assert call_on_host_loop(None, call) == "applied"
    ended = asyncio.new_event_loop()
    ended.close()
    assert call_on_host_loop(ended, call) == "applied"

    async def on_the_loop() -> object:
        return call_on_host_loop(asyncio.get_running_loop(), call)

    assert asyncio.run(on_the_loop()) == "applied"
    assert call.threads == [threading.get_ident()] * 3


def test_a_call_handed_to_a_loop_closed_since_it_was_seen_running_is_run_here():
    """The loop ran when the delivery looked, and closed before the hand-over: the
    hand-over raised, the version staged for the write was never applied nor let go."""

    loop = asyncio.new_event_loop()
    loop.close()
    loop.is_running = lambda: True  # type: ignore[method-assign]  # as it was seen
    call = _Call()
    assert call_on_host_loop(loop, call) == "applied"
    assert call.threads == [threading.get_ident()]


def test_a_call_whose_task_the_host_cancelled_while_its_loop_runs_on_is_run_here(monkeypatch):
    """The host cancelled its loop's tasks (a shutdown of its own) before the handed one
    took its first step, and the loop ran on: the delivering thread waited for it for
    good, holding the version staged for the write."""
    real_hand_over = asyncio.run_coroutine_threadsafe

    def hand_over_then_cancel_every_task(coroutine, to):  # type: ignore[no-untyped-def]
        future = real_hand_over(coroutine, to)
        # Queued after the hand-over's own callback, before the task's first step.
        to.call_soon_threadsafe(lambda: [task.cancel() for task in asyncio.all_tasks(to)])
        go_on.set()
        return future

    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", hand_over_then_cancel_every_task)
    loop = asyncio.new_event_loop()
    blocking, go_on = threading.Event(), threading.Event()

    def busy_until_handed() -> None:
        blocking.set()
        go_on.wait(30)

    loop.call_soon(busy_until_handed)
    looping = threading.Thread(target=loop.run_forever, daemon=True)
    looping.start()
    try:
        assert blocking.wait(30)
        call = _Call()
        outcome: list[object] = []
        calling = threading.Thread(target=lambda: outcome.append(call_on_host_loop(loop, call)))
        calling.start()
        calling.join(30)
        assert not calling.is_alive(), "the call waited for a task cancelled before it ran"
        assert outcome == ["applied"] and call.threads == [calling.ident]
    finally:
        go_on.set()
        loop.call_soon_threadsafe(loop.stop)
        looping.join(30)
        loop.close()


def test_a_call_handed_to_a_loop_that_ends_before_its_turn_is_run_here(handed):
    """The host's loop was running when the call was handed to it and ended before
    running it (a user method's own ``asyncio.run`` returned): the delivery waited for
    it for good, its ack never sent, its payload never released."""
    loop = asyncio.new_event_loop()
    blocking = threading.Event()

    def busy_then_stop() -> None:  # the loop's last turn: what is handed now never runs
        blocking.set()
        handed.wait(30)
        loop.stop()

    def run_loop() -> None:
        loop.call_soon(busy_then_stop)
        loop.run_forever()
        loop.close()

    looping = threading.Thread(target=run_loop, daemon=True)
    call = _run_once_from_a_thread(lambda: loop, looping, blocking)
    assert call.threads != [looping.ident]


def test_a_call_whose_task_asyncio_run_cancelled_is_run_here(handed):
    """The call was handed to a method's own ``asyncio.run`` loop as its main coroutine
    returned: ``asyncio.run`` cancels the task before its first step. The delivery
    raised CancelledError for a version never tried."""
    seen: list[asyncio.AbstractEventLoop] = []
    looping = threading.Event()

    async def main() -> None:  # blocks its loop until the call is handed, then returns
        seen.append(asyncio.get_running_loop())
        looping.set()
        handed.wait(30)

    running = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    _run_once_from_a_thread(lambda: seen[0], running, looping)


def test_a_call_the_loop_ran_in_its_last_turn_is_not_run_again(handed):
    """The loop ran the handed call in the turn it stopped in, before the reply came
    back to the calling thread (a loop the user runs and stops, never closed): that
    thread ran the call a second time."""
    loop = asyncio.new_event_loop()
    blocking = threading.Event()

    def busy_then_stop_after_the_call() -> None:
        blocking.set()
        handed.wait(30)
        # Turns from here: the call's task is made, then runs, and the loop stops with
        # it; its reply's way to the other thread would come a turn later.
        loop.call_soon(lambda: loop.call_soon(loop.stop))

    loop.call_soon(busy_then_stop_after_the_call)
    looping = threading.Thread(target=loop.run_forever, daemon=True)
    try:
        call = _run_once_from_a_thread(lambda: loop, looping, blocking)
        assert call.threads == [looping.ident]
    finally:
        loop.close()


def test_a_read_off_the_loop_runs_on_raysyncs_threads_when_the_users_executor_is_busy():
    """The loop's default executor is the user's (one thread here, busy with their
    work): a version's read waited behind it."""

    async def main() -> str:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        release = threading.Event()
        users = loop.run_in_executor(None, release.wait, 30)
        try:
            reader = await asyncio.wait_for(
                read_off_loop(lambda: threading.current_thread().name), 10
            )
        finally:
            release.set()
        await users
        return reader

    reader = asyncio.run(main())
    assert reader.startswith("raysync-read"), reader


def test_a_write_handed_from_a_read_off_the_loop_goes_back_to_the_loop_it_came_from():
    """The read's write goes to the loop the delivery came on, not to the loop the
    receiver saw a reader on last (an actor's concurrency group runs a loop of its
    own, which a sync method may hold for as long as it loops)."""
    other = asyncio.new_event_loop()
    other_thread = threading.Thread(target=other.run_forever, daemon=True)
    other_thread.start()
    write = _Call()
    try:

        async def main() -> tuple[object, int]:
            result = await read_off_loop(lambda: call_on_host_loop(other, write))
            return result, threading.get_ident()

        result, delivering_loop_thread = asyncio.run(main())
    finally:
        other.call_soon_threadsafe(other.stop)
        other_thread.join(10)
        other.close()
    assert result == "applied"
    assert write.threads == [delivering_loop_thread]


def test_a_read_off_the_loop_starts_with_none_of_the_coroutines_context():
    marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="none")

    async def main() -> str:
        marker.set("the coroutine's")
        return await read_off_loop(marker.get)

    assert asyncio.run(main()) == "none"


def _hold_the_loop(
    loop: asyncio.AbstractEventLoop, holding: threading.Event, release: threading.Event
) -> None:
    """Run on ``loop``: a synchronous method that holds its thread (a concurrency
    group's looper), ``holding`` while it does, until ``release``."""
    with holding_its_loop():
        holding.set()
        release.wait(30)


def test_a_call_for_a_loop_a_sync_method_holds_is_run_here_standing_in_for_it():
    """A sync method of an async actor's concurrency group holds its loop's thread (it
    loops for good, with safe points): a call handed to that loop waited for it to
    return, for good."""
    loop = asyncio.new_event_loop()
    holding, release = threading.Event(), threading.Event()
    loop.call_soon(_hold_the_loop, loop, holding, release)
    looping = threading.Thread(target=loop.run_forever, daemon=True)
    looping.start()
    try:
        assert holding.wait(30)
        call = _Call()
        assert _call_in_a_thread(loop, call) == ["applied"]
        assert call.threads != [looping.ident] and call.standing_in == [True]
    finally:
        release.set()
        loop.call_soon_threadsafe(loop.stop)
        looping.join(30)
        loop.close()
    assert not standing_in_for_a_loop()
    assert call_on_host_loop(None, call) == "applied" and call.standing_in == [True, False]


def test_a_call_handed_to_a_loop_a_sync_method_then_holds_is_run_here_once(monkeypatch):
    """The call was handed to the loop just before a sync method began to hold its thread
    (ahead of it in the loop's queue): the call is taken back and run standing in for
    the loop, and the handed task, once the method returns, does not run it again."""
    real_hand_over = asyncio.run_coroutine_threadsafe
    handed_tasks: list[Any] = []
    handed = threading.Event()

    def hand_over(coroutine, to):  # type: ignore[no-untyped-def]
        handed_tasks.append(real_hand_over(coroutine, to))
        handed.set()
        return handed_tasks[-1]

    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", hand_over)
    loop = asyncio.new_event_loop()
    holding, release = threading.Event(), threading.Event()

    def hold_once_handed() -> None:
        handed.wait(30)
        _hold_the_loop(loop, holding, release)

    loop.call_soon(hold_once_handed)
    looping = threading.Thread(target=loop.run_forever, daemon=True)
    looping.start()
    try:
        call = _Call()
        assert _call_in_a_thread(loop, call) == ["applied"]
        assert holding.is_set() and call.standing_in == [True]
        release.set()
        [task] = handed_tasks
        assert task.result(30) is None  # ran on the loop once released: found it taken
        assert call.threads != [looping.ident] and len(call.threads) == 1
    finally:
        release.set()
        loop.call_soon_threadsafe(loop.stop)
        looping.join(30)
        loop.close()

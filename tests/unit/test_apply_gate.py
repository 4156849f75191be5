"""ApplyGate (raysync/gate.py) without Ray: user methods as readers, applies as the writer.

Threaded actors: a write waits for running readers, readers that arrive while a write
waits go after it, ``safe_point`` and nested reads, a failing apply, and many threads
reading while a writer applies, never seeing a half-applied write. Async actors: writes
deferred while a reader is parked, applied by the last reader out or at a safe point,
and a waiting write dropped (``supersede``) when a newer one of the same key comes.

Threads meet through Events and the gate's own condition (instrumented to say which
thread blocks in it); no sleep is used to order anything.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from raysync import gate as gate_module
from raysync.gate import DEFERRED, ApplyGate
from raysync.host_loop import call_on_host_loop

#: Seconds any handshake may take before the test fails (never reached when it passes).
TIMEOUT = 10.0


class _WatchedCondition(threading.Condition):
    """The gate's condition, telling which threads have blocked in it."""

    def __init__(self) -> None:
        super().__init__()
        self._events: dict[str, threading.Event] = {}
        self._events_lock = threading.Lock()

    def blocked(self, thread_name: str) -> threading.Event:
        """Set once the thread of that name waits in the gate. It is set while that thread
        still holds the gate's lock, so nothing the gate guards changes until the thread
        really waits."""
        with self._events_lock:
            return self._events.setdefault(thread_name, threading.Event())

    def wait(self, timeout: float | None = None) -> bool:
        self.blocked(threading.current_thread().name).set()
        return super().wait(timeout)


def _watched_gate(finished: list[Any]) -> tuple[ApplyGate, _WatchedCondition]:
    gate = ApplyGate(finish_deferred=finished.append)
    cond = _WatchedCondition()
    gate._cond = cond
    return gate, cond


class _Worker(threading.Thread):
    """A thread running ``target``; :meth:`finish` joins it and returns or raises its outcome."""

    def __init__(self, name: str, target: Callable[[], Any]) -> None:
        super().__init__(name=name, daemon=True)
        self._fn = target
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as err:
            self.error = err

    def finish(self) -> Any:
        self.join(TIMEOUT)
        assert not self.is_alive(), f"{self.name} is still blocked"
        if self.error is not None:
            raise self.error
        return self.result


def _started(name: str, target: Callable[[], Any]) -> _Worker:
    worker = _Worker(name, target)
    worker.start()
    return worker


def _wait(event: threading.Event, what: str) -> None:
    assert event.wait(TIMEOUT), f"timed out waiting until {what}"


def _poll(gate: ApplyGate, holds: Callable[[], bool], what: str) -> None:
    """Until ``holds()`` (asked holding the gate's lock) for state that changes with no
    event to wait on: a timed wait's end, a loop's callback."""
    for _ in range(10_000):
        with gate._cond:
            if holds():
                return
        threading.Event().wait(0.001)
    pytest.fail(f"timed out waiting until {what}")


def _setter(model: dict[str, int], version: int) -> Callable[[], str]:
    def apply() -> str:
        model["v"] = version
        return f"ack-{version}"

    return apply


# -- threaded actors ---------------------------------------------------------------------


def test_uncontended_write_runs_at_once_and_returns_its_result():
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}
    assert gate.write(_setter(model, 1)) == "ack-1"
    assert model["v"] == 1
    assert finished == []  # only deferred writes go through finish_deferred


def test_what_a_write_calls_on_its_thread_runs_inside_it():
    """``on_weights_applied`` runs inside the write: a user method it calls (a read, one
    that comes to safe points) or a pull or ``close`` (a write) runs at once; each
    waited for the write, which waited for it, and the actor hung for good."""
    gate = ApplyGate(finish_deferred=lambda _: None)

    def calls_a_user_method() -> str:
        with gate.reading():
            gate.safe_point()
            return "read inside"

    outcomes: list[Any] = []
    worker = threading.Thread(
        target=lambda: outcomes.extend(
            [gate.write(calls_a_user_method), gate.write(lambda: gate.write(lambda: "nested"))]
        ),
        daemon=True,  # on a gate that deadlocks, it never ends
    )
    worker.start()
    worker.join(TIMEOUT)
    assert not worker.is_alive() and outcomes == ["read inside", "nested"]
    with gate.reading():  # and the gate is free again
        pass


def test_write_waits_until_the_running_reader_returns():
    gate, cond = _watched_gate([])
    model = {"v": 0}
    inside, leave = threading.Event(), threading.Event()

    def reader() -> int:
        with gate.reading():
            inside.set()
            _wait(leave, "the test lets the reader go")
            return model["v"]

    r = _started("reader", reader)
    _wait(inside, "the reader holds the gate")
    w = _started("writer", lambda: gate.write(_setter(model, 1)))
    _wait(cond.blocked("writer"), "the writer blocks")
    assert model["v"] == 0  # not applied under the reader
    leave.set()
    assert r.finish() == 0  # the reader saw one version all along
    assert w.finish() == "ack-1"
    assert model["v"] == 1


def test_a_reader_arriving_while_a_write_waits_goes_after_the_write():
    gate, cond = _watched_gate([])
    model = {"v": 0}
    order: list[str] = []
    inside, leave = threading.Event(), threading.Event()

    def first_reader() -> None:
        with gate.reading():
            inside.set()
            _wait(leave, "the test lets the first reader go")
            order.append("first reader left")

    def apply() -> str:
        order.append("write")
        return _setter(model, 1)()

    def second_reader() -> int:
        with gate.reading():
            order.append("second reader entered")
            return model["v"]

    a = _started("reader-a", first_reader)
    _wait(inside, "the first reader holds the gate")
    w = _started("writer", lambda: gate.write(apply))
    _wait(cond.blocked("writer"), "the writer blocks")
    b = _started("reader-b", second_reader)
    _wait(cond.blocked("reader-b"), "the second reader blocks behind the waiting write")
    assert order == []
    leave.set()
    a.finish()
    assert w.finish() == "ack-1"
    assert b.finish() == 1
    assert order == ["first reader left", "write", "second reader entered"]


def test_safe_point_lets_a_waiting_write_in_and_the_reader_holds_again_after():
    gate, cond = _watched_gate([])
    model = {"v": 0}
    inside, go, resumed, leave = (threading.Event() for _ in range(4))

    def long_reader() -> tuple[int, int]:
        with gate.reading():
            inside.set()
            _wait(go, "the test lets the reader reach its safe point")
            before = model["v"]
            gate.safe_point()
            after = model["v"]
            resumed.set()
            _wait(leave, "the test lets the reader go")
            return before, after

    r = _started("reader", long_reader)
    _wait(inside, "the reader holds the gate")
    w1 = _started("writer-1", lambda: gate.write(_setter(model, 1)))
    _wait(cond.blocked("writer-1"), "the first write blocks")
    go.set()
    _wait(resumed, "the reader returns from its safe point")
    assert w1.finish() == "ack-1"
    # Back from the safe point, the reader holds the model again: the next write waits.
    w2 = _started("writer-2", lambda: gate.write(_setter(model, 2)))
    _wait(cond.blocked("writer-2"), "the second write blocks")
    assert model["v"] == 1
    leave.set()
    assert r.finish() == (0, 1)
    assert w2.finish() == "ack-2"
    assert model["v"] == 2


def test_a_safe_point_lets_in_a_write_past_its_first_turn():
    """A write that waited ``writer_first_s`` lets new readers in first again; a
    looping method's safe points must still let it in (they returned at once, and the
    version waited for the method to end: for ever, for a loop that never does)."""
    gate, cond = _watched_gate([])
    gate._writer_first_s = 0.2
    model = {"v": 0}
    inside, turn_over = threading.Event(), threading.Event()

    def loop() -> int:
        with gate.reading():
            inside.set()
            _wait(turn_over, "the write's first turn is over")
            gate.safe_point()
            return model["v"]

    def probe() -> int:
        with gate.reading():  # waits while the write has its first turn
            return model["v"]

    reader = _started("loop", loop)
    _wait(inside, "the loop reads")
    writer = _started("writer", lambda: gate.write(_setter(model, 1)))
    _wait(cond.blocked("writer"), "the write waits")
    assert _started("probe", probe).finish() == 0
    turn_over.set()
    assert reader.finish() == 1  # applied at the safe point
    assert writer.finish() == "ack-1"


def test_two_looping_methods_let_in_a_write_past_its_first_turn():
    """Two threads each in ``while ...: safe_point()``, one of them in a step longer
    than the write's first turn as it began. Past that turn each safe point found the
    other method running and returned at once, at every turn: the version waited for
    as long as they ran. Now each waits for the other's safe point."""
    gate, cond = _watched_gate([])
    gate._writer_first_s = 0.2
    model = {"v": 0}
    inside = {name: threading.Event() for name in ("a", "b")}
    go = {name: threading.Event() for name in ("a", "b")}

    def loop(name: str) -> Callable[[], int]:
        def run() -> int:
            with gate.reading():
                inside[name].set()
                _wait(go[name], f"{name} may loop")
                deadline = time.monotonic() + TIMEOUT
                while model["v"] == 0 and time.monotonic() < deadline:
                    gate.safe_point()
                return model["v"]

        return run

    loops = [_started(name, loop(name)) for name in ("a", "b")]
    for event in inside.values():
        _wait(event, "both methods read")
    writer = _started("writer", lambda: gate.write(_setter(model, 1)))
    _wait(cond.blocked("writer"), "the write waits")
    go["a"].set()  # a loops; b is in a long step
    _wait(cond.blocked("a"), "a's safe point waits for the write's first turn")
    _poll(gate, lambda: not gate._writers_waiting, "the write's first turn is over")
    go["b"].set()  # b's long step ends: both loop
    assert [method.finish() for method in loops] == [1, 1]
    assert writer.finish() == "ack-1"


def test_a_method_in_a_long_step_since_its_safe_point_holds_the_others_a_while_only():
    """Past a write's first turn, b came to a safe point once, then went into a long
    step: a's safe points wait for b's next one ``writer_first_s`` after b's last at
    most, then a loops on (each of them waited that long, turn after turn); once b
    loops again the write goes."""
    gate, cond = _watched_gate([])
    gate._writer_first_s = 0.2
    model = {"v": 0}
    inside = {name: threading.Event() for name in ("a", "b")}
    a_go, b_came, b_back = threading.Event(), threading.Event(), threading.Event()
    turns_while_b_away = []

    def a() -> int:
        with gate.reading():
            inside["a"].set()
            _wait(a_go, "b came to its safe point")
            deadline = time.monotonic() + TIMEOUT
            turns = 0
            while turns < 100 and time.monotonic() < deadline:
                gate.safe_point()
                turns += 1
            turns_while_b_away.append(turns)
            b_back.set()
            while model["v"] == 0 and time.monotonic() < deadline:
                gate.safe_point()
            return model["v"]

    def b() -> int:
        with gate.reading():
            inside["b"].set()
            _wait(b_came, "the write's first turn is over")
            gate.safe_point()  # a runs: returns at once
            a_go.set()
            _wait(b_back, "a looped")  # the long step
            deadline = time.monotonic() + TIMEOUT
            while model["v"] == 0 and time.monotonic() < deadline:
                gate.safe_point()
            return model["v"]

    methods = [_started("a", a), _started("b", b)]
    for event in inside.values():
        _wait(event, "both methods read")
    writer = _started("writer", lambda: gate.write(_setter(model, 1)))
    _wait(cond.blocked("writer"), "the write waits")
    _poll(gate, lambda: not gate._writers_waiting, "the write's first turn is over")
    b_came.set()
    assert [method.finish() for method in methods] == [1, 1]
    assert turns_while_b_away == [100]
    assert writer.finish() == "ack-1"


def test_safe_point_with_no_waiting_write_returns_at_once():
    gate = ApplyGate(finish_deferred=lambda result: None)
    model = {"v": 0}

    def reader() -> int:
        with gate.reading():
            gate.safe_point()
            gate.safe_point()
        gate.safe_point()  # outside any user method too
        return model["v"]

    assert _started("reader", reader).finish() == 0
    # The reader is gone: a write goes through at once.
    assert gate.write(_setter(model, 1)) == "ack-1"


def test_a_nested_read_does_not_wait_for_a_waiting_write():
    gate, cond = _watched_gate([])
    model = {"v": 0}
    inside, go = threading.Event(), threading.Event()

    def reader() -> int:
        with gate.reading():
            inside.set()
            _wait(go, "the test lets the reader call a nested method")
            with gate.reading():  # a guarded method calling another one
                return model["v"]

    r = _started("reader", reader)
    _wait(inside, "the reader holds the gate")
    w = _started("writer", lambda: gate.write(_setter(model, 1)))
    _wait(cond.blocked("writer"), "the writer blocks")
    go.set()
    assert r.finish() == 0  # no deadlock, and still the version it started with
    assert w.finish() == "ack-1"
    assert model["v"] == 1


def test_a_write_from_inside_the_only_reader_applies_at_once_and_the_read_goes_on():
    gate, cond = _watched_gate([])
    model = {"v": 0}
    wrote, leave = threading.Event(), threading.Event()

    def pulling_reader() -> tuple[str, int]:
        with gate.reading():
            result = gate.write(_setter(model, 1))  # pull mode: apply from a user method
            seen = model["v"]
            wrote.set()
            _wait(leave, "the test lets the reader go")
            return result, seen

    r = _started("reader", pulling_reader)
    _wait(wrote, "the reader's own write is applied")
    w = _started("writer", lambda: gate.write(_setter(model, 2)))
    _wait(cond.blocked("writer"), "a delivery waits for the reader")
    assert model["v"] == 1
    leave.set()
    assert r.finish() == ("ack-1", 1)
    assert w.finish() == "ack-2"
    assert model["v"] == 2


def test_a_write_from_inside_a_reader_waits_for_the_other_readers():
    gate, cond = _watched_gate([])
    model = {"v": 0}
    other_inside, other_leave, go = threading.Event(), threading.Event(), threading.Event()

    def other_reader() -> int:
        with gate.reading():
            other_inside.set()
            _wait(other_leave, "the test lets the other reader go")
            return model["v"]

    def pulling_reader() -> str:
        with gate.reading():
            _wait(go, "the test lets the reader pull")
            return gate.write(_setter(model, 1))

    b = _started("reader-b", other_reader)
    _wait(other_inside, "the other reader holds the gate")
    a = _started("reader-a", pulling_reader)
    go.set()
    _wait(cond.blocked("reader-a"), "the pulling reader's write blocks")
    assert model["v"] == 0
    other_leave.set()
    assert b.finish() == 0
    assert a.finish() == "ack-1"
    assert model["v"] == 1


def test_a_failing_apply_leaves_the_gate_usable_and_lets_blocked_readers_in():
    gate, cond = _watched_gate([])
    model = {"v": 0}
    inside, leave = threading.Event(), threading.Event()

    def failing_apply() -> str:
        raise RuntimeError("copy failed")

    def first_reader() -> None:
        with gate.reading():
            inside.set()
            _wait(leave, "the test lets the first reader go")

    def second_reader() -> int:
        with gate.reading():
            return model["v"]

    a = _started("reader-a", first_reader)
    _wait(inside, "the first reader holds the gate")
    w = _started("writer", lambda: gate.write(failing_apply))
    _wait(cond.blocked("writer"), "the writer blocks")
    b = _started("reader-b", second_reader)
    _wait(cond.blocked("reader-b"), "the second reader blocks behind the write")
    leave.set()
    a.finish()
    with pytest.raises(RuntimeError, match="copy failed"):
        w.finish()
    assert b.finish() == 0
    assert gate.write(_setter(model, 2)) == "ack-2"
    assert _started("reader-c", second_reader).finish() == 2


def test_threaded_readers_never_see_a_half_applied_write():
    readers, writes, size = 4, 40, 1 << 16
    gate = ApplyGate(finish_deferred=lambda result: None)
    first, second = torch.zeros(size), torch.zeros(size)
    start = threading.Barrier(readers + 1)
    stop = threading.Event()
    seen_cond = threading.Condition()
    latest_seen = [-1] * readers
    torn: list[tuple[int, float, float, float, float]] = []

    def apply(version: int) -> int:
        # Two tensors written one after the other: between them the model mixes versions.
        first.fill_(float(version))
        second.fill_(float(version))
        return version

    def reader(index: int) -> list[int]:
        versions: list[int] = []
        start.wait(TIMEOUT)
        while not stop.is_set():
            with gate.reading():
                a, b = first.clone(), second.clone()
            low, high = min(a.min(), b.min()).item(), max(a.max(), b.max()).item()
            if low != high:
                torn.append((index, a.min().item(), a.max().item(), b.min().item(), b.max().item()))
            version = int(low)
            if not versions or versions[-1] != version:
                versions.append(version)
            with seen_cond:
                latest_seen[index] = version
                seen_cond.notify_all()
        return versions

    def all_saw(version: int) -> None:
        with seen_cond:
            assert seen_cond.wait_for(lambda: min(latest_seen) >= version, TIMEOUT), (
                f"readers stuck below version {version}: {latest_seen}"
            )

    def writer() -> list[int]:
        acks = []
        start.wait(TIMEOUT)
        all_saw(0)
        for version in range(1, writes + 1):
            acks.append(gate.write(lambda v=version: apply(v)))
            # Let every reader read this version before the next write: they all see
            # each version, and keep reading while the next one is applied.
            all_saw(version)
        stop.set()
        return acks

    workers = [_started(f"reader-{i}", lambda i=i: reader(i)) for i in range(readers)]
    w = _started("writer", writer)
    try:
        assert w.finish() == list(range(1, writes + 1))
    finally:
        stop.set()
    seen = [r.finish() for r in workers]
    assert torn == []
    for versions in seen:
        assert versions == list(range(writes + 1)), versions


# -- async actors ------------------------------------------------------------------------


def _run(coro: Any) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, TIMEOUT)

    return asyncio.run(bounded())


class _Parked:
    """An async reader that holds the gate, parked at an ``await`` until released."""

    def __init__(self, gate: ApplyGate, model: dict[str, int]) -> None:
        self.inside = asyncio.Event()
        self.release = asyncio.Event()
        self._gate, self._model = gate, model
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> int:
        async with self._gate.reading_async():
            self.inside.set()
            await self.release.wait()
            return self._model["v"]

    async def started(self) -> _Parked:
        await self.inside.wait()
        return self

    async def finish(self) -> int:
        self.release.set()
        return await self.task


def test_async_write_with_no_reader_applies_at_once():
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}

    async def main() -> Any:
        return gate.write(_setter(model, 1))

    assert _run(main()) == "ack-1"
    assert model["v"] == 1 and finished == []


def test_async_write_while_a_reader_is_parked_is_deferred_until_it_returns():
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}

    async def main() -> None:
        reader = await _Parked(gate, model).started()
        assert gate.write(_setter(model, 1)) is DEFERRED
        assert model["v"] == 0 and finished == []
        assert await reader.finish() == 0  # the reader kept its version to the end
        # The last reader out applied it and handed the result on.
        assert model["v"] == 1
        assert finished == ["ack-1"]

    _run(main())


def _supersedable(
    name: str, applied: list[str], superseded: list[str]
) -> tuple[Callable[[], str], Callable[[], Callable[[Any], str]]]:
    def apply() -> str:
        applied.append(name)
        return f"ack {name}"

    def supersede() -> Callable[[Any], str]:
        superseded.append(name)
        return lambda newer: f"{name} superseded, after {newer}"

    return apply, supersede


def test_a_deferred_write_is_superseded_by_a_newer_one_of_the_same_key():
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    applied: list[str] = []
    superseded: list[str] = []

    async def main() -> None:
        reader = await _Parked(gate, {"v": 0}).started()
        for version in (1, 2, 3):
            apply, supersede = _supersedable(f"v{version}", applied, superseded)
            assert gate.write(apply, key="policy", supersede=supersede) is DEFERRED
            # The older write is dropped at once (its staged data freed), not at the
            # safe point: a busy actor holds one waiting version.
            assert superseded == [f"v{v}" for v in range(1, version)]
        assert applied == [] and finished == []
        await reader.finish()

    _run(main())
    assert applied == ["v3"]
    assert superseded == ["v1", "v2"]
    # The newest result first, then each superseded write's outcome, made from it.
    assert finished == [
        "ack v3",
        "v2 superseded, after ack v3",
        "v1 superseded, after ack v3",
    ]


def test_an_ack_that_cannot_be_sent_leaves_the_superseded_versions_acks_theirs():
    finished: list[Any] = []

    def send(ack: Any) -> None:
        if ack == "ack v2":
            raise ConnectionError("hub unreachable")
        finished.append(ack)

    gate = ApplyGate(finish_deferred=send)
    applied: list[str] = []
    superseded: list[str] = []

    async def main() -> None:
        reader = await _Parked(gate, {"v": 0}).started()
        for version in (1, 2):
            apply, supersede = _supersedable(f"v{version}", applied, superseded)
            assert gate.write(apply, key="policy", supersede=supersede) is DEFERRED
        with pytest.raises(ConnectionError, match="hub unreachable"):
            await reader.finish()  # the last reader out ran them: the error is its

    _run(main())
    assert applied == ["v2"]
    assert finished == ["v1 superseded, after ack v2"]


def test_deferred_writes_of_other_keys_or_without_supersede_are_all_applied_in_order():
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    applied: list[str] = []
    superseded: list[str] = []

    async def main() -> None:
        reader = await _Parked(gate, {"v": 0}).started()
        writes = [
            ("policy", "policy-1", True),
            ("critic", "critic-1", True),
            (None, "unkeyed-1", True),  # no key: never superseded
            ("policy", "policy-2", False),  # no supersede: it drops policy-1, never dropped
            ("policy", "policy-3", True),
            (None, "unkeyed-2", True),
        ]
        for key, name, can_supersede in writes:
            apply, supersede = _supersedable(name, applied, superseded)
            result = gate.write(apply, key=key, supersede=supersede if can_supersede else None)
            assert result is DEFERRED
        await reader.finish()

    _run(main())
    assert superseded == ["policy-1"]
    assert applied == ["critic-1", "unkeyed-1", "policy-2", "policy-3", "unkeyed-2"]
    assert finished == [
        "ack critic-1",
        "ack unkeyed-1",
        "ack policy-2",
        "policy-1 superseded, after ack policy-2",
        "ack policy-3",
        "ack unkeyed-2",
    ]


def test_a_new_async_reader_waits_for_the_deferred_writes_first():
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}
    order: list[str] = []

    async def late_reader() -> int:
        async with gate.reading_async():
            order.append("late reader entered")
            return model["v"]

    def apply() -> str:
        order.append("write")
        return _setter(model, 1)()

    async def main() -> None:
        reader = await _Parked(gate, model).started()
        assert gate.write(apply) is DEFERRED
        late = asyncio.create_task(late_reader())
        await asyncio.sleep(0)  # one loop turn: the late reader runs up to its wait
        assert not late.done() and order == []
        assert await reader.finish() == 0
        assert await late == 1
        assert order == ["write", "late reader entered"]

    _run(main())
    assert finished == ["ack-1"]


def test_a_nested_async_read_does_not_wait_for_deferred_writes():
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}

    async def main() -> None:
        inside, go = asyncio.Event(), asyncio.Event()

        async def outer() -> tuple[int, list[Any]]:
            async with gate.reading_async():
                inside.set()
                await go.wait()
                async with gate.reading_async():  # would deadlock if it waited
                    nested = model["v"]
                return nested, list(finished)  # the nested exit applied nothing

        task = asyncio.create_task(outer())
        await inside.wait()
        assert gate.write(_setter(model, 1)) is DEFERRED
        go.set()
        assert await task == (0, [])

    _run(main())
    assert model["v"] == 1 and finished == ["ack-1"]


def test_an_async_safe_point_applies_deferred_writes_when_its_reader_is_alone():
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}

    async def main() -> None:
        inside, go = asyncio.Event(), asyncio.Event()

        async def long_reader() -> tuple[int, int, list[Any]]:
            async with gate.reading_async():
                inside.set()
                await go.wait()
                before = model["v"]
                gate.safe_point()
                return before, model["v"], list(finished)

        task = asyncio.create_task(long_reader())
        await inside.wait()
        assert gate.write(_setter(model, 1)) is DEFERRED
        go.set()
        # Applied and acknowledged inside the method, at its safe point.
        assert await task == (0, 1, ["ack-1"])

    _run(main())
    assert finished == ["ack-1"]


def test_an_async_safe_point_lets_in_a_thread_write_waiting_for_its_reader_alone():
    """A coroutine reading, with safe points (``while True: await collect();
    safe_point()``): a write from a thread (a pull of a user's thread, a receiver
    retired from one) waited for it to return, for good. Its safe point lets the write
    in, and waits for it (a write applies without the loop)."""
    gate, cond = _watched_gate([])
    model = {"v": 0}

    async def main() -> list[int]:
        seen = []
        async with gate.reading_async():
            pulling = _started("pull", lambda: gate.write(_setter(model, 1)))
            await asyncio.to_thread(_wait, cond.blocked("pull"), "the pull waits")
            seen.append(model["v"])
            gate.safe_point()
            seen.append(model["v"])
        assert await asyncio.to_thread(pulling.finish) == "ack-1"
        return seen

    assert _run(main()) == [0, 1]


def test_an_async_safe_point_applies_nothing_while_another_reader_is_parked():
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}

    async def main() -> None:
        other = await _Parked(gate, model).started()
        inside, go = asyncio.Event(), asyncio.Event()

        async def reader_with_safe_point() -> int:
            async with gate.reading_async():
                inside.set()
                await go.wait()
                gate.safe_point()
                return model["v"]

        task = asyncio.create_task(reader_with_safe_point())
        await inside.wait()
        assert gate.write(_setter(model, 1)) is DEFERRED
        go.set()
        assert await task == 0  # the other reader still holds version 0
        assert model["v"] == 0 and finished == []
        assert await other.finish() == 0
        assert model["v"] == 1 and finished == ["ack-1"]

    _run(main())


def test_an_async_write_from_inside_the_only_reader_applies_at_once():
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}

    async def main() -> tuple[Any, int]:
        async with gate.reading_async():
            result = gate.write(_setter(model, 1))  # pull mode on an async actor
            return result, model["v"]

    assert _run(main()) == ("ack-1", 1)
    assert finished == []


def test_a_sync_read_on_the_event_loop_does_not_block_it():
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}

    async def main() -> int:
        reader = await _Parked(gate, model).started()
        assert gate.write(_setter(model, 1)) is DEFERRED
        # A sync user method of an async actor runs on the loop: it cannot wait for the
        # deferred write (that would block the loop), and no write runs under it.
        with gate.reading():
            seen = model["v"]
        await reader.finish()
        return seen

    assert _run(main()) == 0
    assert model["v"] == 1 and finished == ["ack-1"]


def test_a_write_that_comes_late_with_a_lower_rank_follows_the_waiting_one():
    """An older version delivered after a newer one (a retry crossing a learner's own
    delivery) must not drop the newer: it is the one superseded."""
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    applied: list[str] = []
    superseded: list[str] = []

    async def main() -> None:
        reader = await _Parked(gate, {"v": 0}).started()
        for name, rank in (("v5", 5), ("v4", 4)):
            apply, supersede = _supersedable(name, applied, superseded)
            assert gate.write(apply, key="policy", supersede=supersede, rank=rank) is DEFERRED
        assert superseded == ["v4"]
        await reader.finish()

    _run(main())
    assert applied == ["v5"]
    assert finished == ["ack v5", "v4 superseded, after ack v5"]


# -- async hosts with a write from another thread (a pull in asyncio.to_thread) ----------


def test_a_write_from_another_thread_waits_for_parked_coroutines_and_goes_when_they_leave():
    gate, cond = _watched_gate([])
    model = {"v": 0}

    async def main() -> None:
        reader = await _Parked(gate, model).started()
        writer = _started("writer", lambda: gate.write(_setter(model, 1)))
        await asyncio.to_thread(_wait, cond.blocked("writer"), "the writer waits for the reader")
        assert model["v"] == 0
        assert await reader.finish() == 0  # the reader kept its version to the end
        assert await asyncio.to_thread(writer.finish) == "ack-1"  # woken as it left
        assert model["v"] == 1

    _run(main())


def test_a_coroutine_starting_while_another_thread_writes_waits_for_the_write():
    gate = ApplyGate(finish_deferred=lambda result: None)
    model = {"v": 0}
    inside, finish = threading.Event(), threading.Event()

    def slow_apply() -> str:
        inside.set()
        _wait(finish, "the test lets the write finish")
        model["v"] = 1
        return "ack-1"

    async def reader() -> int:
        async with gate.reading_async():
            return model["v"]

    async def main() -> None:
        writer = _started("writer", lambda: gate.write(slow_apply))
        await asyncio.to_thread(_wait, inside, "the write runs")
        late = asyncio.create_task(reader())
        await asyncio.sleep(0)  # one loop turn: the reader runs up to its wait
        assert not late.done()
        finish.set()
        assert await late == 1  # it entered after the write, never during it
        assert await asyncio.to_thread(writer.finish) == "ack-1"

    _run(main())


def test_a_deferred_write_that_raises_lets_the_others_run_and_waiting_readers_in():
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}

    def failing_apply() -> str:
        raise RuntimeError("release failed")

    async def late_reader() -> int:
        async with gate.reading_async():
            return model["v"]

    async def main() -> None:
        reader = await _Parked(gate, model).started()
        assert gate.write(failing_apply, key="a") is DEFERRED
        assert gate.write(_setter(model, 1), key="b") is DEFERRED
        late = asyncio.create_task(late_reader())
        await asyncio.sleep(0)
        assert not late.done()
        with pytest.raises(RuntimeError, match="release failed"):
            await reader.finish()  # the last reader out ran them: the error is its
        assert await late == 1  # the other write ran, and the waiting reader went on

    _run(main())
    assert finished == ["ack-1"]


def test_coroutines_waiting_for_a_thread_write_leave_the_loops_threads_to_the_readers():
    """While another thread's write waits for the coroutines reading, those that start
    wait for it without taking the loop's executor threads: a reader that needs one to
    finish (asyncio.to_thread inside the read) still gets it, leaves, and the write and
    then the waiting coroutines go on."""
    gate, cond = _watched_gate([])
    model = {"v": 0}

    async def reader() -> int:
        async with gate.reading_async():
            return model["v"]

    async def main() -> None:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=1))
        inside, leave = asyncio.Event(), asyncio.Event()

        async def holder() -> int:
            async with gate.reading_async():
                inside.set()
                await leave.wait()
                return await asyncio.to_thread(lambda: model["v"])  # needs the one thread

        held = asyncio.create_task(holder())
        await inside.wait()
        writer = _started("writer", lambda: gate.write(_setter(model, 1)))
        await asyncio.to_thread(_wait, cond.blocked("writer"), "the writer waits")
        waiting = [asyncio.create_task(reader()) for _ in range(3)]
        await asyncio.sleep(0)
        leave.set()
        assert await held == 0
        assert await asyncio.gather(*waiting) == [1, 1, 1]
        writer.finish()

    _run(main())


# -- reads started by one context and used by another -----------------------------------
@pytest.mark.parametrize("loop_announced", [True, False])
def test_a_write_deferred_while_a_thread_reads_on_an_async_host_runs_when_it_ends(
    loop_announced: bool,
):
    """An async host's thread-side read (a late joiner served through ``__ray_call__``, a
    user thread in ``using()``) holds a write deferred on the loop: when it ends the
    write runs, and the host's coroutines are not left waiting for it for good. Also on
    a host whose loop no coroutine read announced (it connected in its ``__init__``;
    only its threads read): the last thread out handed the write to no loop, and it
    waited for the next coroutine or delivery."""
    finished: list[Any] = []
    ran = threading.Event()
    gate = ApplyGate(finish_deferred=lambda result: (finished.append(result), ran.set()))
    inside, release = threading.Event(), threading.Event()

    def serve() -> None:
        with gate.reading():
            inside.set()
            release.wait(TIMEOUT)

    async def main() -> None:
        if loop_announced:
            async with gate.reading_async():
                pass
        thread = threading.Thread(target=serve)
        thread.start()
        await asyncio.to_thread(inside.wait, TIMEOUT)
        assert gate.write(lambda: "v2", key="m") is DEFERRED
        release.set()
        await asyncio.to_thread(thread.join, TIMEOUT)
        assert await asyncio.to_thread(ran.wait, TIMEOUT), "the deferred write never ran"

        async def user_method() -> list[Any]:
            async with gate.reading_async():
                return list(finished)

        assert await asyncio.wait_for(user_method(), TIMEOUT) == ["v2"]

    asyncio.run(main())


def test_a_task_started_inside_a_read_writes_once_that_read_ended():
    """``start()`` holds a read while it starts a refresh task: the task inherits the
    read's context, but once ``start`` returned it holds nothing (a pull then applies at
    once, neither deferred for ever nor waiting on a read nobody holds)."""
    gate = ApplyGate(finish_deferred=lambda result: None)

    async def main() -> None:
        async def refresh() -> Any:
            return gate.write(lambda: "v2", key="m")

        async with gate.reading_async():
            task = asyncio.create_task(refresh())
            in_thread = asyncio.create_task(asyncio.to_thread(gate.write, lambda: "v3", "m"))
        assert await asyncio.wait_for(task, TIMEOUT) == "v2"
        assert await asyncio.wait_for(in_thread, TIMEOUT) == "v3"

    asyncio.run(main())


def test_a_task_started_inside_a_read_waits_for_another_parked_reader():
    """Its copied read must not count as the parked reader's: the write is deferred
    until that reader leaves, not applied in the middle of its read."""
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    applied: list[str] = []

    async def main() -> None:
        parked, resume = asyncio.Event(), asyncio.Event()
        seen: list[list[str]] = []

        async def reader() -> None:
            async with gate.reading_async():
                parked.set()
                await resume.wait()
                seen.append(list(applied))

        async def refresh() -> Any:
            await parked.wait()
            return gate.write(lambda: applied.append("v2") or "v2", key="m")

        async with gate.reading_async():
            task = asyncio.create_task(refresh())
        parked_reader = asyncio.create_task(reader())
        assert await asyncio.wait_for(task, TIMEOUT) is DEFERRED
        resume.set()
        await asyncio.wait_for(parked_reader, TIMEOUT)
        assert seen == [[]] and applied == ["v2"] and finished == ["v2"]

    asyncio.run(main())


def test_a_write_from_a_thread_the_only_reader_awaits_applies_at_once():
    """A user coroutine pulling through ``to_thread`` holds the model for that thread."""
    gate = ApplyGate(finish_deferred=lambda result: None)

    async def main() -> None:
        async with gate.reading_async():
            pulled = asyncio.to_thread(gate.write, lambda: "v2", "m")
            assert await asyncio.wait_for(pulled, TIMEOUT) == "v2"

    asyncio.run(main())


def test_a_write_deferred_just_as_what_held_it_back_ends_still_runs(monkeypatch):
    """A delivery on the loop finds another thread's write running and is deferred;
    that write ends before the delivery is listed as deferred (so it schedules
    nothing): the delivery must still run, with nothing else coming to run it."""
    done = threading.Event()
    ran: list[Any] = []
    gate = ApplyGate(finish_deferred=lambda result: (ran.append(result), done.set()))
    entered, go = threading.Event(), threading.Event()

    def slow_apply() -> str:
        entered.set()
        go.wait(TIMEOUT)
        return "thread"

    thread = threading.Thread(target=gate.write, args=(slow_apply, "m"))
    pending_write = gate_module._Pending

    def ends_first(*pending: Any) -> gate_module._Pending:
        """Made between the check that found the thread writing and the listing (the
        gate's lock free): the thread's write ends here."""
        go.set()
        thread.join(TIMEOUT)
        assert not thread.is_alive()
        return pending_write(*pending)

    async def main() -> None:
        gate.note_loop()
        thread.start()
        await asyncio.to_thread(entered.wait, TIMEOUT)
        with monkeypatch.context() as patch:
            patch.setattr(gate_module, "_Pending", ends_first)
            assert gate.write(lambda: "loop", key="m") is DEFERRED
        await asyncio.wait_for(asyncio.to_thread(done.wait, TIMEOUT), TIMEOUT)

    asyncio.run(main())
    assert ran == ["loop"]


def test_a_reader_waiting_on_another_threads_reader_does_not_deadlock_a_waiting_write():
    """A user method calls another through a thread pool (whose thread holds no read of
    its own) while a write waits: the pool's call waits for the write, which waits for
    the method. After ``writer_first_s`` new readers go first again; the method ends and
    the write goes."""
    gate, cond = _watched_gate([])
    gate._writer_first_s = 0.2
    inside, write_waits = threading.Event(), threading.Event()

    def inner_call() -> str:
        with gate.reading():
            return "inner"

    def rollout() -> str:
        with gate.reading(), ThreadPoolExecutor(1) as pool:
            inside.set()
            _wait(write_waits, "the write waits")
            return pool.submit(inner_call).result(TIMEOUT)

    reader = _started("rollout", rollout)
    _wait(inside, "the user method reads")
    writer = _started("write", lambda: gate.write(lambda: "v2"))
    _wait(cond.blocked("write"), "the write blocks in the gate")
    write_waits.set()
    assert reader.finish() == "inner"
    assert writer.finish() == "v2"


# -- user methods that wait for other user methods --------------------------------------


def test_a_reader_that_gathers_other_readers_while_a_write_is_deferred_ends():
    """``generate`` (a user method) fans out to ``generate_one`` (user methods too) with
    ``asyncio.gather`` after a delivery was deferred: they go at once, since their
    caller waits for them (they waited for the write, which waited for the caller: the
    actor was stuck for good). The write runs as ``generate`` returns."""
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}

    async def generate_one(prompt: int) -> tuple[int, int]:
        async with gate.reading_async():
            return prompt, model["v"]

    async def generate(prompts: list[int], go: asyncio.Event) -> list[tuple[int, int]]:
        async with gate.reading_async():
            await go.wait()
            return list(await asyncio.gather(*(generate_one(p) for p in prompts)))

    async def main() -> list[tuple[int, int]]:
        go = asyncio.Event()
        task = asyncio.create_task(generate([1, 2, 3], go))
        await asyncio.sleep(0)  # one loop turn: generate reads, parked on go
        assert gate.write(_setter(model, 1), key="m") is DEFERRED
        go.set()
        return await task

    assert _run(main()) == [(1, 0), (2, 0), (3, 0)]  # one version throughout
    assert model["v"] == 1 and finished == ["ack-1"]


def test_a_reader_that_gathers_other_readers_while_a_thread_write_waits_ends():
    """The same with a write from another thread waiting for ``generate``."""
    gate, cond = _watched_gate([])
    model = {"v": 0}

    async def generate_one(prompt: int) -> tuple[int, int]:
        async with gate.reading_async():
            return prompt, model["v"]

    async def main() -> None:
        go = asyncio.Event()

        async def generate() -> list[tuple[int, int]]:
            async with gate.reading_async():
                await go.wait()
                return list(await asyncio.gather(*(generate_one(p) for p in (1, 2))))

        task = asyncio.create_task(generate())
        await asyncio.sleep(0)  # one loop turn: generate reads, parked on go
        writer = _started("writer", lambda: gate.write(_setter(model, 1)))
        await asyncio.to_thread(_wait, cond.blocked("writer"), "the write waits")
        go.set()
        assert await task == [(1, 0), (2, 0)]
        assert await asyncio.to_thread(writer.finish) == "ack-1"
        assert model["v"] == 1

    _run(main())


class _Server:
    """Two user methods of one async actor: ``serve`` reads until ``submit`` (another
    call, not started by it) brings an item; ``serve`` returns the model's version
    when it began and when it ended."""

    def __init__(self, gate: ApplyGate, model: dict[str, int]) -> None:
        self._gate, self._model = gate, model
        self._items: asyncio.Queue[int] = asyncio.Queue()

    async def serve(self) -> tuple[int, int]:
        async with self._gate.reading_async():
            before = self._model["v"]
            await self._items.get()
            return before, self._model["v"]

    async def submit(self, item: int) -> None:
        async with self._gate.reading_async():
            self._items.put_nowait(item)


def test_a_reader_waiting_for_another_call_lets_it_in_after_a_deferred_writes_turn():
    """``serve`` (a user method) waits for items that ``submit`` (another call of the
    actor, not started by it) brings; a delivery deferred meanwhile keeps ``submit``
    waiting for ``writer_first_s`` only, then it goes, ``serve`` ends and the write
    runs (it kept the actor stuck for good)."""
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append, writer_first_s=0.2)
    model = {"v": 0}

    async def main() -> tuple[int, int]:
        server = _Server(gate, model)
        serving = asyncio.create_task(server.serve())
        await asyncio.sleep(0)  # one loop turn: serve reads, waits for an item
        assert gate.write(_setter(model, 1), key="m") is DEFERRED
        await server.submit(7)
        return await serving

    assert _run(main()) == (0, 0)
    assert model["v"] == 1 and finished == ["ack-1"]


def test_a_reader_waiting_for_another_call_lets_it_in_after_a_thread_writes_turn():
    """The same with a write from another thread: after ``writer_first_s`` it lets the
    coroutines waiting for it in too, not only threads."""
    gate, cond = _watched_gate([])
    gate._writer_first_s = 0.2
    model = {"v": 0}

    async def main() -> None:
        server = _Server(gate, model)
        serving = asyncio.create_task(server.serve())
        await asyncio.sleep(0)  # one loop turn: serve reads, waits for an item
        writer = _started("writer", lambda: gate.write(_setter(model, 1)))
        await asyncio.to_thread(_wait, cond.blocked("writer"), "the write waits")
        await server.submit(7)
        assert await serving == (0, 0)
        assert await asyncio.to_thread(writer.finish) == "ack-1"
        assert model["v"] == 1

    _run(main())


def _half_apply(
    model: dict[str, int],
) -> tuple[Callable[[], str], threading.Event, threading.Event]:
    """An apply that writes ``a``, sets ``halfway``, waits for ``finish``, writes ``b``."""
    halfway, finish = threading.Event(), threading.Event()

    def apply() -> str:
        model["a"] = 1
        halfway.set()
        _wait(finish, "the reader waits in the gate")
        model["b"] = 1
        return "v1"

    return apply, halfway, finish


def test_a_sync_read_on_the_loop_waits_for_a_thread_write_under_way():
    """A sync user method of an async actor (Ray runs it on the loop) starting while a
    pull's write runs in a thread sees the model after that write, not halfway."""
    gate, cond = _watched_gate([])
    model = {"a": 0, "b": 0}
    apply, halfway, finish = _half_apply(model)

    async def main() -> dict[str, int]:
        async def refresh() -> Any:  # a user coroutine pulling in a thread
            async with gate.reading_async():
                return await asyncio.to_thread(gate.write, apply, "m")

        pulling = asyncio.create_task(refresh())
        await asyncio.to_thread(_wait, halfway, "the write runs")
        loop_thread = threading.current_thread().name
        releaser = _started(
            "releaser", lambda: (_wait(cond.blocked(loop_thread), "it waits"), finish.set())
        )
        with gate.reading():  # the sync method, on the loop
            seen = dict(model)
        releaser.finish()
        assert await pulling == "v1"
        return seen

    assert _run(main()) == {"a": 1, "b": 1}


def test_a_task_started_inside_a_read_lent_to_a_running_write_waits_for_it():
    """A user coroutine (reading) starts a task that reads, then pulls through
    ``to_thread``: its read is lent to the pull's write and holds the model no more.
    The task, started inside it, went in at once and saw the model halfway."""
    gate, _ = _watched_gate([])
    model = {"a": 0, "b": 0}
    apply, halfway, finish = _half_apply(model)

    async def main() -> dict[str, int]:
        seen: dict[str, int] = {}

        async def helper() -> None:
            await asyncio.to_thread(_wait, halfway, "the write runs")
            async with gate.reading_async():
                seen.update(model)

        async with gate.reading_async():
            task = asyncio.create_task(helper())
            releaser = _started(
                "releaser",
                lambda: (
                    _poll(gate, lambda: bool(gate._thread_write_waiters), "the task waits"),
                    finish.set(),
                ),
            )
            assert await asyncio.to_thread(gate.write, apply, "m") == "v1"
        await task
        releaser.finish()
        return seen

    assert _run(main()) == {"a": 1, "b": 1}


def test_a_thread_started_inside_a_read_lent_to_a_running_write_waits_for_it():
    """The same with a sync user method run in a thread of its own (``to_thread``)
    beside the pull: it took the lent read for its caller's and went in at once."""
    gate, cond = _watched_gate([])
    model = {"a": 0, "b": 0}
    apply, halfway, finish = _half_apply(model)
    readers = ThreadPoolExecutor(1, thread_name_prefix="reader")

    def read() -> dict[str, int]:
        _wait(halfway, "the write runs")
        with gate.reading():
            return dict(model)

    async def main() -> dict[str, int]:
        loop = asyncio.get_running_loop()
        async with gate.reading_async():
            context = contextvars.copy_context()  # as to_thread's
            reading = loop.run_in_executor(readers, context.run, read)
            releaser = _started(
                "releaser", lambda: (_wait(cond.blocked("reader_0"), "it waits"), finish.set())
            )
            assert await asyncio.to_thread(gate.write, apply, "m") == "v1"
            seen = await reading
        releaser.finish()
        return seen

    try:
        assert _run(main()) == {"a": 1, "b": 1}
    finally:
        readers.shutdown()


def test_a_thread_write_for_a_task_started_inside_a_read_waits_for_the_other_readers():
    """``start`` (a user method) starts a refresh task that pulls through ``to_thread``
    and returns; the pull's thread carries ``start``'s read, which ends while the write
    waits for another parked reader. The write still waits for that reader (it went on
    as ``start`` left, and that reader saw the model change under it)."""
    gate, cond = _watched_gate([])
    model = {"v": 0}
    pulls = ThreadPoolExecutor(1, thread_name_prefix="pull")  # to_thread's
    waits = ThreadPoolExecutor(1)  # the test's own waits

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(pulls)
        other = await _Parked(gate, model).started()

        async def refresh() -> Any:
            return await asyncio.to_thread(gate.write, _setter(model, 1), "m")

        async with gate.reading_async():  # start
            pulling = asyncio.create_task(refresh())
            await loop.run_in_executor(waits, _wait, cond.blocked("pull_0"), "the write waits")
        # The write waits for the parked reader still (ran as start left, it would
        # hold at most its own apply here: the count says whether it went).
        assert gate._readers == 1
        assert await other.finish() == 0  # its version to the end
        assert await pulling == "ack-1"
        assert model["v"] == 1 and gate._readers == 0

    try:
        _run(main())
    finally:
        pulls.shutdown()
        waits.shutdown()


def test_two_threads_writing_for_one_read_both_apply():
    """A user coroutine pulls two models at once (``asyncio.gather`` of two
    ``to_thread`` pulls): both threads write for its read. The first to finish must
    not count that read again while the second still writes for it (the second would
    then wait for the coroutine, which waits for it)."""
    gate, cond = _watched_gate([])
    model = {"m": 0, "n": 0}
    pulls = ThreadPoolExecutor(2, thread_name_prefix="pull")
    first = threading.Lock()

    def setter(key: str) -> Callable[[], str]:
        def apply() -> str:
            if first.acquire(blocking=False):  # the first in lets the other wait for it
                me = threading.current_thread().name
                other = "pull_1" if me == "pull_0" else "pull_0"
                _wait(cond.blocked(other), "the other pull waits for this write")
            model[key] = 1
            return f"ack-{key}"

        return apply

    async def main() -> None:
        asyncio.get_running_loop().set_default_executor(pulls)
        async with gate.reading_async():
            acks = await asyncio.gather(
                asyncio.to_thread(gate.write, setter("m"), "m"),
                asyncio.to_thread(gate.write, setter("n"), "n"),
            )
            assert gate._readers == 1  # its read counted again once both wrote
        assert acks == ["ack-m", "ack-n"] and model == {"m": 1, "n": 1}
        assert gate._readers == 0

    try:
        _run(main())
    finally:
        pulls.shutdown(wait=False)


def test_a_thread_safe_point_on_an_async_host_applies_the_deferred_writes():
    """An async user method runs its collection loop in a thread (``to_thread``) and
    opens safe points there: a delivery deferred on the loop meanwhile (the coroutine
    holds the model) is applied at the thread's next safe point, not when the loop ends."""
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}
    started, delivered = threading.Event(), threading.Event()

    def collect() -> int:
        started.set()
        _wait(delivered, "the delivery is deferred")
        gate.safe_point()
        return model["v"]

    async def user_method() -> int:
        async with gate.reading_async():
            return await asyncio.to_thread(collect)

    async def main() -> None:
        collecting = asyncio.create_task(user_method())
        await asyncio.to_thread(_wait, started, "the collection loop runs")
        assert gate.write(_setter(model, 1), key="m") is DEFERRED  # a delivery
        delivered.set()
        assert await collecting == 1  # the safe point let the deferred write in
        assert finished == ["ack-1"] and gate._readers == 0

    _run(main())


# -- async generators and several event loops (an async actor's concurrency groups) -------


def test_a_streaming_method_left_unclosed_still_leaves_the_gate():
    """A guarded async generator its caller stops iterating (``break``, or Ray's
    streaming executor on a cancel) is closed by asyncio's finalizer, in a task of its
    own: its read's end raised there (a context variable reset in another context), the
    read stayed counted, and every later write was deferred for good."""
    gate = ApplyGate(finish_deferred=lambda _: None)

    async def stream():
        async with gate.reading_async():
            for item in range(10):
                yield item

    async def user_method() -> None:
        async for item in stream():
            if item == 1:
                break  # left to the finalizer

    async def main() -> Any:
        await asyncio.create_task(user_method())
        gc.collect()
        for _ in range(100):  # the finalizer's task runs within a few turns of the loop
            if not gate._readers:
                break
            await asyncio.sleep(0)
        return gate.write(lambda: "ack-2", key="m")

    assert asyncio.run(main()) == "ack-2"


class _Loops:
    """Two event loops in threads of their own, as Ray runs an async actor's groups."""

    def __init__(self) -> None:
        self.loops = [asyncio.new_event_loop(), asyncio.new_event_loop()]
        self._threads = [
            threading.Thread(target=loop.run_forever, daemon=True) for loop in self.loops
        ]
        for thread in self._threads:
            thread.start()

    def run(self, index: int, coroutine: Any) -> Any:
        """A concurrent future of ``coroutine`` run on loop ``index``."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loops[index])

    def close(self) -> None:
        for loop in self.loops:
            loop.call_soon_threadsafe(loop.stop)
        for thread in self._threads:
            thread.join(TIMEOUT)


@pytest.fixture
def loops():
    loops = _Loops()
    yield loops
    loops.close()


def test_a_reader_on_one_loop_goes_on_once_a_write_on_another_ends(loops):
    """The write found the gate idle on its loop and ran there; a coroutine of the other
    loop that came meanwhile waited for a thread write's end, which never came."""
    gate = ApplyGate(finish_deferred=lambda _: None)
    applying, go_on = threading.Event(), threading.Event()

    def apply() -> str:
        applying.set()
        _wait(go_on, "the reader waits")
        return "ack-1"

    async def write() -> Any:
        return gate.write(apply, key="m")

    async def read() -> str:
        async with gate.reading_async():
            return "read"

    written = loops.run(0, write())
    _wait(applying, "the write runs")
    reader = loops.run(1, read())
    _poll(gate, lambda: bool(gate._thread_write_waiters), "the reader waits for the write")
    go_on.set()
    assert written.result(TIMEOUT) == "ack-1"
    assert reader.result(TIMEOUT) == "read"


def test_readers_of_two_loops_waiting_for_a_deferred_write_both_go_on(loops):
    """Both waited on one asyncio.Event, bound to the loop that waited first: the other
    loop's reader raised, or was never woken (set from another thread) and waited out
    the deferred writes' whole first turn."""
    gate = ApplyGate(finish_deferred=lambda _: None, writer_first_s=60.0)
    parked, release = threading.Event(), threading.Event()

    async def long_read() -> None:
        async with gate.reading_async():
            parked.set()
            while not release.is_set():
                await asyncio.sleep(0.001)

    async def write() -> Any:
        return gate.write(lambda: "ack-2", key="m")

    async def read() -> str:
        async with gate.reading_async():
            return "read"

    long_reader = loops.run(1, long_read())
    _wait(parked, "a method holds the model")
    assert loops.run(1, write()).result(TIMEOUT) is DEFERRED
    readers = [loops.run(0, read()), loops.run(1, read())]
    _poll(gate, lambda: len(gate._drained_waiters) == 2, "both wait for the deferred write")
    release.set()
    long_reader.result(TIMEOUT)
    assert [r.result(TIMEOUT) for r in readers] == ["read", "read"]


def test_a_coroutine_behind_an_overdue_deferred_write_and_a_thread_write_waits_without_spinning(
    monkeypatch,
):
    """A deferred write past its first turn no longer keeps new readers waiting; a thread
    write in its first turn does. A reader coming then went round its wait for the
    deferred writes (zero time left) without ever awaiting the thread write: the loop
    spun at full CPU until the thread write's turn ended."""
    gate, cond = _watched_gate([])
    gate._writer_first_s = 60.0
    drained_waits = 0
    wait_for_deferred = gate._deferred_drained_or_overdue

    async def counted() -> None:
        nonlocal drained_waits
        drained_waits += 1
        await wait_for_deferred()

    monkeypatch.setattr(gate, "_deferred_drained_or_overdue", counted)

    async def main() -> list[Any]:
        release = asyncio.Event()

        async def parked() -> None:
            async with gate.reading_async():
                await release.wait()

        holder = asyncio.create_task(parked())
        await asyncio.sleep(0)
        assert gate.write(lambda: "deferred", key="m") is DEFERRED
        gate._deferred_since -= gate._writer_first_s  # its first turn is over
        writer = _started("writer", lambda: gate.write(lambda: "thread"))
        await asyncio.get_running_loop().run_in_executor(
            None, _wait, cond.blocked("writer"), "the thread write waits"
        )

        async def newcomer() -> str:
            async with gate.reading_async():
                return "read"

        reader = asyncio.create_task(newcomer())
        for _ in range(50):  # turns of the loop while the reader waits
            await asyncio.sleep(0)
        waits = drained_waits
        release.set()
        await holder
        return [waits, writer.finish(), await reader]

    waits, written, read = asyncio.run(main())
    assert waits == 0 and written == "thread" and read == "read"


def test_a_write_deferred_on_a_loop_that_ended_runs_when_the_thread_holding_it_leaves():
    """A sync method reads the model (a thread-side read) and, inside it, reads it again
    in its own ``asyncio.run``: the gate took that loop for the host's, and a write
    handed to it there was deferred behind the thread's read. The loop ended before
    the thread's read did; the write was left to that loop, which never ran again: no
    ack, its payload held, and a thread's ``safe_point`` then waited for it for good."""
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)

    async def read_again_and_get_a_write() -> Any:
        async with gate.reading_async():
            return gate.write(lambda: "v1", key="m")

    outcome: list[Any] = []

    def user_method() -> None:
        with gate.reading():
            outcome.append(asyncio.run(read_again_and_get_a_write()))

    thread = threading.Thread(target=user_method)
    thread.start()
    thread.join(TIMEOUT)
    assert outcome == [DEFERRED] and finished == ["v1"]
    waiting = threading.Thread(target=gate.safe_point, daemon=True)
    waiting.start()
    waiting.join(TIMEOUT)
    assert not waiting.is_alive(), "safe_point waited for a write no loop runs"


def test_a_write_deferred_on_one_loop_while_another_runs_the_deferred_ones_runs_too(loops):
    """Loop 0 ran the deferred writes; a write that came on loop 1 meanwhile was deferred
    behind them and left to them, which had taken theirs already: it waited, its ack
    unsent, until some user method began or ended."""
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    parked, leave, applying, go_on = (threading.Event() for _ in range(4))

    def first_apply() -> str:
        applying.set()
        _wait(go_on, "the second write is deferred")
        return "ack-1"

    async def read() -> None:
        async with gate.reading_async():
            parked.set()
            await asyncio.get_running_loop().run_in_executor(None, leave.wait, TIMEOUT)

    async def write(apply: Callable[[], str]) -> Any:
        return gate.write(apply, key=None)

    reader = loops.run(0, read())
    _wait(parked, "a method holds the model")
    assert loops.run(0, write(first_apply)).result(TIMEOUT) is DEFERRED
    leave.set()  # the reader leaves, and runs the deferred write on loop 0
    _wait(applying, "the deferred write runs")
    assert loops.run(1, write(lambda: "ack-2")).result(TIMEOUT) is DEFERRED
    go_on.set()
    reader.result(TIMEOUT)
    _poll(gate, lambda: len(finished) == 2, "the second write ran (a loop's callback)")
    assert finished == ["ack-1", "ack-2"]


# -- two receivers in one process, each with its gate ------------------------------------


def test_a_read_of_one_gate_inside_a_read_of_another_holds_its_model():
    """A user method reads model 1, then model 2 inside that read (two receivers in one
    process). The read of gate 2 found gate 1's read held and took itself for a nested
    one (one read held per process, not per gate): it counted nothing, and a delivery
    to receiver 2 applied at once, in the middle of the method's use of model 2."""
    gate1 = ApplyGate(finish_deferred=lambda _: None)
    gate2, cond2 = _watched_gate([])
    model = {"v": 0}
    inside, leave = threading.Event(), threading.Event()
    settled = cond2.blocked("writer")  # the write blocks, or (it went at once) applied

    def reader() -> int:
        with gate1.reading(), gate2.reading():
            inside.set()
            _wait(leave, "the test lets the reader go")
            return model["v"]

    def apply() -> str:
        result = _setter(model, 1)()
        settled.set()
        return result

    r = _started("reader", reader)
    _wait(inside, "the reader holds both models")
    w = _started("writer", lambda: gate2.write(apply))
    _wait(settled, "the write to gate 2 blocks")
    with gate2._cond:
        assert model["v"] == 0 and gate2._readers == 1  # not applied under the reader
    leave.set()
    assert r.finish() == 0
    assert w.finish() == "ack-1"
    assert model["v"] == 1 and gate1._readers == gate2._readers == 0


def test_a_safe_point_of_one_gate_inside_a_read_of_another_lends_nothing():
    """A method reading model 1 opens a safe point of gate 2: it lent its read of gate 1
    on gate 2, whose count went down by a read it never counted, and a write waiting on
    gate 2 applied under another method reading model 2."""
    gate1 = ApplyGate(finish_deferred=lambda _: None)
    gate2, cond2 = _watched_gate([])
    model = {"v": 0}
    inside, leave = threading.Event(), threading.Event()

    def reader() -> int:
        with gate2.reading():
            inside.set()
            _wait(leave, "the test lets the reader go")
            return model["v"]

    def looper() -> int:
        with gate1.reading():
            gate2.safe_point()  # waits for the write to gate 2, which waits for reader
            return model["v"]

    r = _started("reader", reader)
    _wait(inside, "a method reads model 2")
    w = _started("writer", lambda: gate2.write(_setter(model, 1)))
    _wait(cond2.blocked("writer"), "the write to gate 2 blocks")
    loop = _started("looper", looper)
    _wait(cond2.blocked("looper"), "the safe point of gate 2 waits")
    with gate2._cond:  # a lent read is counted again only once the write ran
        assert (model["v"], gate2._readers, gate1._readers) == (0, 1, 1)
    leave.set()
    assert r.finish() == 0
    assert w.finish() == "ack-1"
    assert loop.finish() == 1
    assert gate1._readers == gate2._readers == 0


def test_a_pull_of_one_gate_inside_async_reads_of_two_gates_applies():
    """An async user method reads model 1, then model 2 inside that read, and pulls
    model 1 through ``to_thread``: the read of gate 2 was counted on gate 1's read (its
    depth 2 for a count of 1), the pull lent both, left gate 1 at -1 readers and
    waited for good."""
    gate1 = ApplyGate(finish_deferred=lambda _: None)
    gate2 = ApplyGate(finish_deferred=lambda _: None)
    model = {"v": 0}

    async def main() -> tuple[Any, tuple[int, int]]:
        async with gate1.reading_async(), gate2.reading_async():
            context = contextvars.copy_context()  # as to_thread's, in a daemon thread:
            pull = _started(  # on a gate that hangs, it never ends
                "pull", lambda: context.run(gate1.write, _setter(model, 1), "m")
            )
            result = await asyncio.to_thread(pull.finish)
            return result, (gate1._readers, gate2._readers)

    assert _run(main()) == ("ack-1", (1, 1))
    assert model["v"] == 1 and gate1._readers == gate2._readers == 0


def test_a_pull_on_the_loop_inside_a_read_of_another_gate_waits_for_its_readers():
    """A coroutine reading model 1 pulls model 2 on the loop while another coroutine is
    parked reading model 2: its read of gate 1 was taken off gate 2's count and the
    write applied under the parked reader."""
    finished: list[Any] = []
    gate1 = ApplyGate(finish_deferred=lambda _: None)
    gate2 = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}

    async def main() -> None:
        other = await _Parked(gate2, model).started()
        async with gate1.reading_async():
            assert gate2.write(_setter(model, 1), key="m") is DEFERRED
        assert await other.finish() == 0  # its version to the end
        assert model["v"] == 1 and finished == ["ack-1"]

    _run(main())


# -- a read lent to a thread's write, and threads started inside a read -----------------


def test_an_async_safe_point_with_its_read_lent_applies_nothing_under_another_reader():
    """A coroutine inside its read starts a pull through ``to_thread`` without awaiting
    it: the pull's write lends that read and waits for a parked reader. The coroutine
    then opens a safe point: its lent read was taken off the count again (counted
    twice), and the deferred delivery applied under the parked reader."""
    done = threading.Event()
    finished: list[Any] = []
    gate, cond = _watched_gate([])
    gate._finish_deferred = lambda result: (finished.append(result), done.set())
    model = {"v": 0}
    pulls = ThreadPoolExecutor(1, thread_name_prefix="pull")  # to_thread's
    waits = ThreadPoolExecutor(1)  # the test's own waits

    async def deliver() -> Any:  # a delivery, in a task of its own
        return gate.write(_setter(model, 1), key="m")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(pulls)
        other = await _Parked(gate, model).started()
        async with gate.reading_async():
            assert await asyncio.create_task(deliver()) is DEFERRED
            pulling = asyncio.create_task(asyncio.to_thread(gate.write, lambda: "pulled", "n"))
            await loop.run_in_executor(waits, _wait, cond.blocked("pull_0"), "the pull waits")
            gate.safe_point()
            assert model["v"] == 0 and finished == []  # the parked reader still reads
        assert await other.finish() == 0
        assert await pulling == "pulled"
        await loop.run_in_executor(waits, _wait, done, "the deferred write ran")
        assert model["v"] == 1 and finished == ["ack-1"] and gate._readers == 0

    try:
        _run(main())
    finally:
        pulls.shutdown()
        waits.shutdown()


def test_a_guarded_method_run_in_a_thread_not_awaited_holds_the_model_after_its_starter():
    """A user coroutine starts a guarded sync method (``log_stats``) through
    ``to_thread`` without awaiting it, and returns: the thread took its starter's read
    for its own, counted nothing, and a delivery applied at once under it."""
    finished: list[Any] = []
    done = threading.Event()
    gate = ApplyGate(finish_deferred=lambda result: (finished.append(result), done.set()))
    model = {"v": 0}
    inside, leave = threading.Event(), threading.Event()
    waits = ThreadPoolExecutor(1)  # the test's own waits

    def log_stats() -> int:
        with gate.reading():
            inside.set()
            _wait(leave, "the test lets log_stats go")
            return model["v"]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with gate.reading_async():
            stats = asyncio.create_task(asyncio.to_thread(log_stats))
            await loop.run_in_executor(waits, _wait, inside, "log_stats reads")
        try:
            assert gate.write(_setter(model, 1), key="m") is DEFERRED  # log_stats reads
        finally:
            leave.set()
        assert await stats == 0
        await loop.run_in_executor(waits, _wait, done, "the deferred write ran")
        assert model["v"] == 1 and finished == ["ack-1"] and gate._readers == 0

    try:
        _run(main())
    finally:
        waits.shutdown()


def test_a_guarded_method_run_in_a_thread_that_pulls_applies_at_once():
    """A user coroutine awaits a guarded sync method that pulls, run through
    ``to_thread``: the method's read (counted, its own) and its starter's, which awaits
    it, are both lent to the pull, which does not wait for either."""
    gate = ApplyGate(finish_deferred=lambda _: None)
    model = {"v": 0}

    def pull() -> tuple[Any, int]:
        with gate.reading():
            return gate.write(_setter(model, 1), key="m"), model["v"]

    async def main() -> tuple[tuple[Any, int], int]:
        async with gate.reading_async():
            pulled = await asyncio.to_thread(pull)
            return pulled, gate._readers

    assert _run(main()) == (("ack-1", 1), 1)
    assert gate._readers == 0


def test_a_guarded_method_run_in_a_thread_goes_at_once_while_a_thread_write_waits():
    """A user coroutine awaits a guarded sync method run through ``to_thread`` while a
    write of another thread waits for the coroutine: the method goes at once (waiting
    for the write, it would wait for its own starter), and the write goes after."""
    gate, cond = _watched_gate([])
    model = {"v": 0}

    def read() -> int:
        with gate.reading():
            return model["v"]

    async def main() -> None:
        async with gate.reading_async():
            writer = _started("writer", lambda: gate.write(_setter(model, 1)))
            await asyncio.to_thread(_wait, cond.blocked("writer"), "the write waits")
            assert await asyncio.to_thread(read) == 0
        assert await asyncio.to_thread(writer.finish) == "ack-1"
        assert model["v"] == 1 and gate._readers == 0

    _run(main())


def test_a_write_off_every_loop_is_deferred_to_a_sync_looper_of_another_loop(loops):
    """An async actor's async methods run on loop 0; a sync method of a concurrency group
    loops for good on loop 1, with safe points. A delivery that arrives off every loop (a
    channel's, a ``__ray_call__``) is handed to the gate's loop: the looper's, noted as
    it began to read, where the write waited behind it for good (its safe points run
    only writes deferred to them). Handed to the async readers' loop, it is deferred,
    and the looper's next safe point applies it."""
    gate = ApplyGate(finish_deferred=lambda _: None)
    model = {"v": 0}
    looping, stop = threading.Event(), threading.Event()
    seen: list[int] = []

    async def async_read() -> None:
        async with gate.reading_async():
            pass

    async def looper() -> None:  # a sync method, run on its group's loop
        with gate.reading():
            looping.set()
            while not stop.is_set():
                seen.append(model["v"])
                gate.safe_point()
                threading.Event().wait(0.001)

    loops.run(0, async_read()).result(TIMEOUT)
    looped = loops.run(1, looper())
    try:
        _wait(looping, "the looper reads")
        write = functools.partial(gate.write, _setter(model, 1), key="m")
        written = _started("delivery", lambda: call_on_host_loop(gate.loop, write))
        assert written.finish() is DEFERRED  # not blocked behind the looper
        _poll(gate, lambda: model["v"] == 1, "the looper's safe point applies the version")
    finally:
        stop.set()
    looped.result(TIMEOUT)
    assert seen == sorted(seen)


def test_a_write_off_every_loop_is_deferred_to_a_sync_looper_that_read_first(loops):
    """As above, but the looper began to read before any coroutine did (the receiver
    connected from ``__init__``, off every loop): its loop is the gate's, the one a
    delivery that arrives off every loop is handed to, where the write waited behind it
    for good. The delivery's own thread defers it instead, as that loop would have, and
    the looper's next safe point applies it and acks it."""
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}
    looping, stop = threading.Event(), threading.Event()
    seen: list[int] = []

    async def looper() -> None:  # a sync method, run on its group's loop
        with gate.reading():
            looping.set()
            while not stop.is_set():
                seen.append(model["v"])
                gate.safe_point()
                threading.Event().wait(0.001)

    looped = loops.run(1, looper())
    try:
        _wait(looping, "the looper reads")
        assert gate.loop is loops.loops[1]
        write = functools.partial(gate.write, _setter(model, 1), key="m")
        written = _started("delivery", lambda: call_on_host_loop(gate.loop, write))
        assert written.finish() is DEFERRED  # not blocked behind the looper
        _poll(gate, lambda: bool(seen) and seen[-1] == 1, "the looper sees the version")
        assert finished == ["ack-1"]
    finally:
        stop.set()
    looped.result(TIMEOUT)
    assert seen == sorted(seen) and gate._readers == 0


def test_a_write_for_a_loop_a_sync_looper_of_another_gate_holds_applies_at_once(loops):
    """The looper holds its loop's thread reading another receiver's model: a delivery
    for this receiver, whose loop that is, waited behind it for good. No reader holds
    this receiver's model: the delivery's own thread applies it at once."""
    other_gate = ApplyGate(finish_deferred=lambda _: None)
    finished: list[Any] = []
    gate = ApplyGate(finish_deferred=finished.append)
    model = {"v": 0}
    looping, stop = threading.Event(), threading.Event()

    async def looper() -> None:  # a sync method of the other receiver's host
        with other_gate.reading():
            looping.set()
            stop.wait(TIMEOUT)

    looped = loops.run(1, looper())
    try:
        _wait(looping, "the looper reads")
        write = functools.partial(gate.write, _setter(model, 1), key="m")
        written = _started("delivery", lambda: call_on_host_loop(loops.loops[1], write))
        assert written.finish() == "ack-1"
        assert model["v"] == 1 and finished == []
    finally:
        stop.set()
    looped.result(TIMEOUT)


def test_a_thread_write_goes_at_a_safe_point_of_a_sync_looper_on_the_loop(loops):
    """A sync method loops for good on its group's loop, reading, with safe points
    (``while True: collect(); safe_point()``). A write made straight from a thread (a
    receiver retired as it closes from a thread, a pull of a user's thread) waited
    behind it for good, past its first turn too: the looper's safe points, on the loop,
    let in only writes deferred to them. The looper's next safe point lets it in, and
    waits for it to end: the looper never sees half of it."""
    gate = ApplyGate(finish_deferred=lambda _: None)
    model = {"a": 0, "b": 0}
    looping, stop = threading.Event(), threading.Event()
    seen: list[tuple[int, int]] = []

    def retire() -> str:
        model["a"] = 1
        threading.Event().wait(0.01)  # a looper running now would see it halfway
        model["b"] = 1
        return "retired"

    async def looper() -> None:  # a sync method, run on its group's loop
        with gate.reading():
            looping.set()
            while not stop.is_set():
                seen.append((model["a"], model["b"]))
                gate.safe_point()
                threading.Event().wait(0.001)

    looped = loops.run(1, looper())
    try:
        _wait(looping, "the looper reads")
        assert _started("closing", lambda: gate.write(retire)).finish() == "retired"
        _poll(gate, lambda: bool(seen) and seen[-1] == (1, 1), "the looper sees it")
    finally:
        stop.set()
    looped.result(TIMEOUT)
    assert set(seen) <= {(0, 0), (1, 1)} and seen == sorted(seen)
    assert gate._readers == 0


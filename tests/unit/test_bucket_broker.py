"""BucketBroker (actors/bucket_broker.py), driven as the plain async class it is: the
learner never gets more than two buckets ahead of the slowest reader, a reader that
holds the others up is dropped with a reason, calls may arrive in any order, and every
way a stream ends frees its buckets and answers its readers."""

from __future__ import annotations

import asyncio
import tracemalloc

import pytest

from raysync.actors import bucket_broker
from raysync.actors.bucket_broker import BucketBroker
from raysync.transports.hand_off import HandOff, HandOffClock
from raysync.transports.object_store.bucket_stream import BUCKETS_IN_FLIGHT, SenderActor, StreamId

TIMEOUT = 10.0
#: The broker looks at its hub every few seconds; these tests end before its first look.
_NO_HUB = object()


def run(coro):
    async def bounded():
        return await asyncio.wait_for(coro, TIMEOUT)

    return asyncio.run(bounded())


def key(count: int = 6, wait_s: float = 5.0) -> StreamId:
    return StreamId("s", count, wait_s)


async def learner(broker: BucketBroker, k: StreamId, log: list) -> None:
    """What the learner's stream_out does, with strings for object refs."""
    for index in range(k.count):
        if index >= BUCKETS_IN_FLIGHT:
            why = await broker.room(k, index)
            if why is not None:
                log.append(("stopped", why))
                return
        log.append(("put", index))
        await broker.offer(k, index, [f"ref{index}"])


async def reader(broker: BucketBroker, k: StreamId, worker: str, log: list) -> list[str]:
    got = []
    for index in range(k.count):
        boxed, why = await broker.take(k, index, worker)
        assert why is None, why
        got.append(boxed[0])
        log.append((worker, index, len(broker._streams["s"].buckets)))
        await asyncio.sleep(0)  # let the learner run between buckets
    assert await broker.take(k, k.count, worker) == (None, None)
    return got


def test_every_reader_gets_every_bucket_and_no_more_than_two_are_held():
    async def main():
        broker, k, log = BucketBroker(_NO_HUB), key(), []
        await broker.readers(k, ["a", "b"])
        results = await asyncio.gather(
            learner(broker, k, log), reader(broker, k, "a", log), reader(broker, k, "b", log)
        )
        return broker, log, results

    broker, log, results = run(main())
    assert results[1] == results[2] == [f"ref{i}" for i in range(6)]
    assert broker.stats().peak_buckets <= BUCKETS_IN_FLIGHT
    assert broker.stats().streams == 0
    held = [entry[2] for entry in log if len(entry) == 3]  # buckets held at each take
    assert len(held) == 12 and max(held) <= BUCKETS_IN_FLIGHT


def test_a_reader_asking_ahead_keeps_the_bucket_it_still_reads():
    """``take(k + 1, copied=k)`` while bucket ``k`` is read: the learner gets no room
    for bucket ``k + 2`` (which would reuse ``k``'s place) until the reader says it
    copied ``k`` too."""

    async def main():
        broker, k = BucketBroker(_NO_HUB), key(count=4)
        await broker.readers(k, ["a"])
        for index in range(2):
            await broker.offer(k, index, [f"ref{index}"])
        assert await broker.take(k, 0, "a") == (["ref0"], None)
        assert await broker.take(k, 1, "a", (), 0) == (["ref1"], None)  # reads 0 still
        room = asyncio.ensure_future(broker.room(k, 2))
        for _ in range(10):  # every turn the broker's room could take without waiting
            await asyncio.sleep(0)
        blocked = not room.done()
        asked = asyncio.ensure_future(broker.take(k, 2, "a", (), 1))  # copied 0, reads 1
        why = await room
        await broker.offer(k, 2, ["ref2"])
        return blocked, why, await asked, broker.stats().peak_buckets

    blocked, why, asked, peak = run(main())
    assert blocked and why is None
    assert asked == (["ref2"], None)
    assert peak <= BUCKETS_IN_FLIGHT


def test_calls_in_any_order_open_the_stream():
    async def main():
        broker, k = BucketBroker(_NO_HUB), key(count=2)
        taking = asyncio.ensure_future(broker.take(k, 0, "a"))  # before the offer and plan
        await asyncio.sleep(0)
        await broker.offer(k, 0, ["ref0"])
        await broker.readers(k, ["a"])
        return await taking

    assert run(main()) == (["ref0"], None)


def test_a_reader_that_holds_the_others_up_is_dropped_and_told_why():
    async def main():
        broker, k, log = BucketBroker(_NO_HUB), key(count=4, wait_s=0.4), []  # stall 0.2 s
        await broker.readers(k, ["quick", "stuck"])
        quick = asyncio.ensure_future(reader(broker, k, "quick", log))
        await learner(broker, k, log)
        await quick
        return await broker.take(k, 0, "stuck")

    boxed, why = run(main())
    assert boxed is None
    assert "dropped from the stream: it had not taken bucket 0 of 4 within 0.2 s" in why


def test_a_reader_is_not_dropped_from_a_stream_it_has_not_begun_to_read():
    """The parts of a version are streams read one after the other: a stream's stall
    clock starts once a reader begins it, not when it was planned (a reader that spent
    longer than the stall on the part before was dropped from the next, and the version
    failed on every receiver)."""

    async def main():
        broker, log = BucketBroker(_NO_HUB), []
        parts = [StreamId(f"part{i}", 6, 1.0) for i in range(2)]  # stall 0.5 s each
        for k in parts:
            await broker.readers(k, ["r"])
        learners = [asyncio.ensure_future(learner(broker, k, log)) for k in parts]
        got = []
        for k in parts:  # 6 buckets of 0.3 s: 1.8 s per part, the second begun after it
            for index in range(k.count):
                boxed, why = await broker.take(k, index, "r")
                assert why is None, why
                got.append(boxed[0])
                await asyncio.sleep(0.3)
            assert await broker.take(k, k.count, "r") == (None, None)
        await asyncio.gather(*learners)
        return got, [entry for entry in log if entry[0] == "stopped"]

    got, stopped = run(main())
    assert got == [f"ref{i}" for i in range(6)] * 2 and stopped == []


def test_readers_of_a_planned_stream_nobody_begins_are_dropped_after_their_wait():
    """A version served to a late joiner whose pull gave up is never read: the receiver
    serving it waited for room for ever, its model held steady. The stream's reader is
    dropped once it has not begun within the receivers' wait from its plan (a
    broadcast's stream waits on: the part streams of a version are read in turn, and
    the broadcast's end ends it)."""

    async def main():
        broker, log = BucketBroker(_NO_HUB), []
        k = StreamId("s", 4, 0.3, served=True)
        await broker.readers(k, ["gone"])
        await learner(broker, k, log)
        return log, await broker.take(k, 0, "gone")

    log, (boxed, why) = run(main())
    assert log == [("put", 0), ("put", 1), ("stopped", "no receiver reads this version any more")]
    assert boxed is None
    assert why == (
        "this receiver was dropped from the stream: no reader began the version within "
        "0.3 s of its plan (its receivers' wait for a bucket)"
    )


@pytest.mark.parametrize(
    ("how", "told"),
    [
        ("dropped", "the hub dropped it (it died or left)"),
        ("left", "it gave the version up (its ack says why)"),
    ],
)
def test_a_reader_that_is_gone_no_longer_holds_the_learner(how, told):
    """The hub dropped it (it died or left), or it said it gives the version up."""

    async def main():
        # A 60 s stall: only that word can let the learner go on in time.
        broker, k, log = BucketBroker(_NO_HUB), key(count=4, wait_s=120), []
        await broker.readers(k, ["quick", "gone"])
        quick = asyncio.ensure_future(reader(broker, k, "quick", log))
        sending = asyncio.ensure_future(learner(broker, k, log))
        while ("put", 1) not in log:
            await asyncio.sleep(0)
        if how == "dropped":
            await broker.drop_reader("gone")
        else:
            await broker.leave(k, "gone")
        await sending
        await quick
        return log, await broker.take(k, 0, "gone")

    log, (boxed, why) = run(main())
    assert [e for e in log if e[0] == "put"] == [("put", i) for i in range(4)]
    assert boxed is None and why.endswith(told), why


def test_a_reader_that_leaves_before_the_hub_plans_the_version_is_not_waited_for():
    """Calls reach the broker in any order: a reader's ``leave`` may open the stream."""

    async def main():
        broker, k, log = BucketBroker(_NO_HUB), key(count=4, wait_s=120), []
        await broker.leave(k, "refuses")
        await broker.readers(k, ["quick", "refuses"])
        quick = asyncio.ensure_future(reader(broker, k, "quick", log))
        await learner(broker, k, log)
        await quick
        return log

    log = run(main())
    assert [e for e in log if e[0] == "put"] == [("put", i) for i in range(4)]


def test_a_receiver_the_hub_dropped_before_a_relay_adopts_it_is_not_waited_for():
    """A relay (distributed's rank 0) that gives a version up names its members readers
    of the rest; the hub may have dropped one of them (dead) before that: the stream
    must not wait for it."""

    async def main():
        # A 60 s stall: waiting for the dead member would time the test out.
        broker, k, log = BucketBroker(_NO_HUB), key(count=4, wait_s=120), []
        await broker.readers(k, ["rank0"])
        await broker.drop_reader("dead")  # the hub heard of the death first
        await broker.readers(k, ["live", "dead"])  # the relay adopts its members
        assert await broker.take(k, 0, "dead") == (
            None,
            "this receiver was dropped from the stream: the hub dropped it (it died or left)",
        )
        assert await broker.take(k, k.count, "rank0") == (None, None)  # it gave up
        live = asyncio.ensure_future(reader(broker, k, "live", log))
        await learner(broker, k, log)
        await live
        return log

    log = run(main())
    assert [e for e in log if e[0] == "put"] == [("put", i) for i in range(4)]


def test_a_stream_the_hub_never_plans_ends_and_frees_its_buckets():
    async def main():
        broker, k = BucketBroker(_NO_HUB), key(count=3, wait_s=0.1)
        await broker.offer(k, 0, ["ref0"])
        why = await broker.room(k, 2)  # waits for a plan that never comes
        return broker, why, await broker.take(k, 0, "late")

    broker, why, (boxed, late) = run(main())
    assert why == "the hub never planned this version"
    assert boxed is None and "the hub never planned this version" in late
    assert broker.stats().streams == 0


def test_a_stream_put_whole_before_its_plan_is_read_to_the_end_after_it():
    """An early part of a version sent in parts: its learner put every bucket, and the
    hub plans the version only once the other parts came. Its readers' time to finish
    runs from the plan, not from the last bucket (they read the parts in turn)."""

    async def main():
        broker, k = BucketBroker(_NO_HUB), key(count=2, wait_s=0.3)
        for index in range(2):
            await broker.offer(k, index, [f"ref{index}"])
        await asyncio.sleep(0.2)  # the other parts come
        await broker.readers(k, ["a"])
        await asyncio.sleep(0.2)  # "a" reads the parts before this one
        taken = [await broker.take(k, index, "a") for index in range(2)]
        return broker, taken, await broker.take(k, 2, "a")

    broker, taken, end = run(main())
    assert taken == [(["ref0"], None), (["ref1"], None)]
    assert end == (None, None) and broker.stats().streams == 0


def test_a_planned_stream_not_read_to_the_end_in_time_ends():
    async def main():
        broker, k = BucketBroker(_NO_HUB), key(count=2, wait_s=0.1)
        await broker.readers(k, ["a"])
        for index in range(2):
            await broker.offer(k, index, [f"ref{index}"])
        await asyncio.sleep(0.3)  # "a" never reads it
        return broker, await broker.take(k, 0, "a")

    broker, (boxed, why) = run(main())
    assert boxed is None and "its readers did not finish in time" in why
    assert broker.stats().streams == 0


def test_a_stream_whose_readers_all_left_ends_though_its_learner_never_asks_again():
    """A driver learner that died mid-version (the broker watches actors only) never
    asks for room again: once its last reader left, the stream stayed for good."""

    async def main():
        broker, k = BucketBroker(_NO_HUB), key(count=4, wait_s=0.1)
        await broker.readers(k, ["a"])
        await broker.offer(k, 0, ["ref0"])
        assert await broker.take(k, 0, "a") == (["ref0"], None)
        await broker.leave(k, "a")
        await asyncio.sleep(0.3)  # past the stream's wait: nothing else happens
        return broker

    assert run(main()).stats().streams == 0


def test_the_learner_ending_a_stream_answers_readers_waiting_for_a_bucket():
    async def main():
        broker, k = BucketBroker(_NO_HUB), key(count=3)
        await broker.readers(k, ["a"])
        waiting = asyncio.ensure_future(broker.take(k, 0, "a"))
        await asyncio.sleep(0)
        await broker.end(k, "the broadcast ended before every bucket was sent")
        return await waiting

    boxed, why = run(main())
    assert boxed is None
    stopped = "the broadcast ended before every bucket was sent"
    assert why == f"the learner stopped sending this version: {stopped}"


@pytest.mark.parametrize("wait_s", [0.05])
def test_a_bucket_that_never_comes_times_the_reader_out(wait_s):
    async def main():
        broker, k = BucketBroker(_NO_HUB), key(count=2, wait_s=wait_s)
        await broker.readers(k, ["a"])
        return await broker.take(k, 0, "a")

    boxed, why = run(main())
    assert boxed is None
    assert (
        why == "bucket 0 of 2 did not arrive within 0.05 s (the learner may have died or stalled)"
    )


def test_a_receiver_that_was_not_a_reader_is_told_the_buckets_are_gone():
    async def main():
        broker, k, log = BucketBroker(_NO_HUB), key(count=3), []
        await broker.readers(k, ["a", "b"])
        sending = asyncio.ensure_future(learner(broker, k, log))
        a = asyncio.ensure_future(reader(broker, k, "a", log))
        for index in range(2):
            await broker.take(k, index, "b")
        late = await broker.take(k, 0, "joiner")
        await broker.take(k, 2, "b")
        await broker.take(k, 3, "b")
        await asyncio.gather(sending, a)
        return late, await broker.take(k, 0, "joiner")

    (boxed, why), (_, after) = run(main())
    assert boxed is None and "bucket 0 of 3 is gone" in why
    assert "the version's stream is over (every reader took it)" in after


def test_each_planner_adds_its_readers_and_a_relay_names_who_it_passed_every_bucket_to():
    # One stream read by object-store receivers and by RPC's agent, which relays it.
    async def main():
        broker, k, log = BucketBroker(_NO_HUB), key(count=3), []
        await broker.readers(k, ["a"])
        await broker.readers(k, ["agent"])

        async def agent() -> None:
            for index in range(k.count):
                assert (await broker.take(k, index, "agent"))[1] is None
                await asyncio.sleep(0)
            assert await broker.take(k, k.count, "agent", ("r0", "r1")) == (None, None)

        got, *_ = await asyncio.gather(
            reader(broker, k, "a", log), agent(), learner(broker, k, log)
        )
        return got, broker.finished(k)

    got, finished = run(main())
    assert got == ["ref0", "ref1", "ref2"]
    assert sorted(finished) == ["a", "agent", "r0", "r1"]


# -- a version several planners name readers of (the hub holds, then seals them) -------
async def _turns(n: int = 20) -> None:
    """Let every call the broker could answer without waiting run."""
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.parametrize("dropped_first", [True, False])
def test_a_receiver_dropped_before_the_next_planner_named_its_relay_frees_no_bucket(
    dropped_first,
):
    """The object store's planner named its one receiver, which died (the hub drops it,
    before or after that plan); ``rpc``'s planner names its agent later. The empty
    reader set freed every bucket offered so far, and the agent's ``take(0)`` was told
    bucket 0 is gone, failing every receiver of the agent with a wrong cause."""

    async def main():
        broker, k, log = BucketBroker(_NO_HUB), key(count=4), []
        await broker.hold(k)  # the hub, before its planners run
        for index in range(2):
            await broker.offer(k, index, [f"ref{index}"])
        if dropped_first:
            await broker.drop_reader("R")
        await broker.readers(k, ["R"])  # the object store's planner
        if not dropped_first:
            await broker.drop_reader("R")
        await broker.readers(k, ["relay"])  # rpc's planner, slower
        await broker.seal(k)  # every planner named its readers
        first = await broker.take(k, 0, "relay")
        got = await asyncio.gather(learner_from(broker, k, 2, log), reader(broker, k, "relay", log))
        return first, got[1], broker.stats().streams

    first, got, streams = run(main())
    assert first == (["ref0"], None)
    assert got == [f"ref{i}" for i in range(4)] and streams == 0


def test_a_relay_ahead_of_the_next_planner_frees_no_bucket_before_the_hub_seals():
    """``rpc``'s agent reads as soon as it is planned: it took buckets 0 and 1 and asked
    for 2 before ``distributed``'s planner (waiting for rank 0's last collective) named
    rank 0. Bucket 0 was freed and the learner went on: rank 0 was told it is gone."""

    async def main():
        broker, k, log = BucketBroker(_NO_HUB), key(count=4), []
        await broker.hold(k)
        await broker.readers(k, ["relay"])
        sending = asyncio.ensure_future(learner(broker, k, log))
        relay = asyncio.ensure_future(reader(broker, k, "relay", log))
        await _turns()
        held = sorted(broker._streams["s"].buckets), [e for e in log if e[0] == "put"]
        await broker.readers(k, ["rank0"])
        await broker.seal(k)
        got = await asyncio.gather(reader(broker, k, "rank0", log), relay, sending)
        return held, got[0], got[1], broker.finished(k)

    held, rank0, relay, finished = run(main())
    assert held == ([0, 1], [("put", 0), ("put", 1)])  # no room for bucket 2 meanwhile
    assert rank0 == relay == [f"ref{i}" for i in range(4)]
    assert sorted(finished) == ["rank0", "relay"]


def test_a_relay_that_read_the_whole_version_before_the_next_planner_leaves_it_open():
    """A version of two buckets: ``rpc``'s agent took both and said it is done before
    rank 0 was named. Its last reader done, the stream ended, and rank 0 was told the
    version's stream is over."""

    async def main():
        broker, k, log = BucketBroker(_NO_HUB), key(count=2), []
        await broker.hold(k)
        await broker.readers(k, ["relay"])
        await asyncio.gather(learner(broker, k, log), reader(broker, k, "relay", log))
        open_before = broker.stats().streams
        await broker.readers(k, ["rank0"])
        await broker.seal(k)
        got = await reader(broker, k, "rank0", log)
        return open_before, got, broker.stats().streams, broker.finished(k)

    open_before, got, streams, finished = run(main())
    assert open_before == 1 and got == ["ref0", "ref1"]
    assert streams == 0 and finished == ["relay", "rank0"]


def test_a_sealed_stream_frees_what_every_reader_took_as_one_planned_at_once():
    async def main():
        broker, k, log = BucketBroker(_NO_HUB), key(), []
        await broker.hold(k)
        await broker.readers(k, ["a"])
        await broker.readers(k, ["b"])
        await broker.seal(k)
        results = await asyncio.gather(
            learner(broker, k, log), reader(broker, k, "a", log), reader(broker, k, "b", log)
        )
        return broker, log, results

    broker, log, results = run(main())
    assert results[1] == results[2] == [f"ref{i}" for i in range(6)]
    held = [entry[2] for entry in log if len(entry) == 3]  # buckets held at each take
    assert max(held) <= BUCKETS_IN_FLIGHT and broker.stats().peak_buckets <= BUCKETS_IN_FLIGHT
    assert broker.stats().streams == 0


def test_a_stream_sealed_with_no_reader_left_stops_its_learner_and_ends():
    """Its only reader died while the hub held its readers open: once sealed, the learner
    is told nobody reads it, and one that never asks again (a dead driver) leaves no
    stream behind."""

    async def main():
        broker, k = BucketBroker(_NO_HUB), key(count=4, wait_s=0.1)
        await broker.hold(k)
        for index in range(2):
            await broker.offer(k, index, [f"ref{index}"])
        await broker.readers(k, ["R"])
        await broker.drop_reader("R")
        room = asyncio.ensure_future(broker.room(k, 2))
        await _turns()
        waited = not room.done()  # held: more readers may come
        await broker.seal(k)
        why = await room
        await asyncio.sleep(0.3)  # past the stream's wait
        return waited, why, broker.stats().streams

    waited, why, streams = run(main())
    assert waited and why == "no receiver reads this version any more"
    assert streams == 0


def test_a_held_stream_the_hub_never_seals_ends_as_one_never_planned():
    """The hub's delivery broke off between ``hold`` and ``seal``: the stream ends when
    one never planned does, its buckets freed, instead of holding its learner for ever."""

    async def main():
        broker, k = BucketBroker(_NO_HUB), key(count=3, wait_s=0.1)
        await broker.hold(k)
        await broker.readers(k, ["a"])
        await broker.offer(k, 0, ["ref0"])
        assert await broker.take(k, 0, "a") == (["ref0"], None)
        why = await broker.room(k, 2)  # waits for the seal, which never comes
        return broker, why, await broker.take(k, 1, "a")

    broker, why, (boxed, told) = run(main())
    assert why == "the hub never planned this version"
    assert boxed is None and "the hub never planned this version" in told
    assert broker.stats().streams == 0


def test_a_member_that_gave_the_version_up_is_not_named_among_those_that_got_it():
    """A distributed member that sits in its collectives unread leaves the stream; rank 0,
    relaying every bucket, names all its members: that one must not be offered to serve
    the version to a late joiner (it does not hold it)."""

    async def main():
        broker, k, log = BucketBroker(_NO_HUB), key(count=2), []
        await broker.readers(k, ["rank0"])
        await broker.leave(k, "m1")

        async def rank0() -> None:
            for index in range(k.count):
                assert (await broker.take(k, index, "rank0"))[1] is None
                await asyncio.sleep(0)
            assert await broker.take(k, k.count, "rank0", ("m0", "m1")) == (None, None)

        await asyncio.gather(rank0(), learner(broker, k, log))
        return broker.finished(k)

    assert sorted(run(main())) == ["m0", "rank0"]


class _Processes:
    """Which process runs each actor, as Ray's GCS would answer the broker (None: dead
    or restarting); ``looks`` counts the broker's questions."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, **running: str | None) -> None:
        self.running = running
        self.looks = 0
        monkeypatch.setattr(bucket_broker, "_process_running", self.look)
        monkeypatch.setattr(bucket_broker, "_SENDER_LOOK_S", 0.0)

    async def look(self, actor_id: str) -> str | None:
        self.looks += 1
        return self.running[actor_id]


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_a_dead_senders_streams_end_at_its_next_look_and_one_watch_covers_them_all(
    monkeypatch,
):
    processes = _Processes(monkeypatch, learner="w1")

    async def main():
        broker = BucketBroker(_NO_HUB)
        sender = SenderActor("learner", "w1")
        keys = [StreamId(f"s{i}", 4, 120.0) for i in range(3)]
        for k in keys:
            await broker.readers(k, ["r"])
            await broker.offer(k, 0, ["ref0"], sender)
        waiting = asyncio.ensure_future(broker.take(keys[0], 1, "r"))  # never offered
        await _settle()
        watches, alive = len(broker._watches), waiting.done()
        processes.running["learner"] = None
        return watches, alive, await waiting, [await broker.take(k, 1, "r") for k in keys[1:]]

    watches, answered_while_alive, (boxed, why), later = run(main())
    assert (watches, answered_while_alive) == (1, False)  # one watch for all three
    assert boxed is None
    assert why == "the learner stopped sending this version: the process sending it died"
    for boxed, why in later:
        assert boxed is None and "(the process sending it died)" in why


def test_a_restarted_senders_former_streams_end_and_its_new_ones_go_on(monkeypatch):
    """Ray restarted the learner's actor: the streams its former process put end; the
    one the new process put (the same actor id) goes on."""
    processes = _Processes(monkeypatch, learner="w1")

    async def main():
        broker = BucketBroker(_NO_HUB)
        former, new = StreamId("a", 2, 120.0), StreamId("b", 2, 120.0)
        await broker.readers(former, ["r"])
        await broker.offer(former, 0, ["a0"], SenderActor("learner", "w1"))
        await _settle()
        processes.running["learner"] = "w2"
        await broker.readers(new, ["r"])
        await broker.offer(new, 0, ["b0"], SenderActor("learner", "w2"))
        await _settle()
        return await broker.take(former, 1, "r"), await broker.take(new, 0, "r")

    (boxed, why), (new_bucket, new_why) = run(main())
    assert boxed is None
    assert "(the process sending it is gone: Ray restarted its actor)" in why
    assert (new_bucket, new_why) == (["b0"], None)


def test_a_learner_that_dies_before_its_first_bucket_ends_its_stream(monkeypatch):
    """The learner handed the version to the hub and died before it offered bucket 0:
    the hub's plan (``readers``) is the first the broker hears of the stream, and the
    stream's id names its learner. Unwatched, the stream's readers waited its whole
    ``wait_s`` for bucket 0 (the next version's broadcast behind it timed out)."""
    processes = _Processes(monkeypatch, learner="w1")

    async def main():
        broker = BucketBroker(_NO_HUB)
        k = StreamId("s", 4, 120.0, sender=SenderActor("learner", "w1"))
        await broker.readers(k, ["r"])
        waiting = asyncio.ensure_future(broker.take(k, 0, "r"))
        await _settle()
        alive = waiting.done()
        processes.running["learner"] = None
        return alive, await waiting

    answered_while_alive, (boxed, why) = run(main())
    assert answered_while_alive is False
    assert boxed is None
    assert why == "the learner stopped sending this version: the process sending it died"


def test_a_sender_is_watched_no_more_once_its_streams_ended(monkeypatch):
    processes = _Processes(monkeypatch, learner="w1")

    async def main():
        broker = BucketBroker(_NO_HUB)
        sender = SenderActor("learner", "w1")
        for k in (StreamId("a", 1, 120.0), StreamId("b", 1, 120.0)):
            await broker.readers(k, ["r"])
            await broker.offer(k, 0, ["ref0"], sender)
            await _settle()  # looked at while it runs
            assert await broker.take(k, 1, "r") == (None, None)  # read to the end
            await _settle()
        looks = processes.looks
        await _settle()
        return looks, processes.looks, broker._watches

    looks, looks_later, watches = run(main())
    assert looks >= 1 and looks_later == looks and watches == {}


async def _paced_stream(learner_pause_s: float, reader_pause_s: float) -> HandOff | None:
    """One stream of 8 buckets to two readers that ask two ahead as receivers do
    (``buckets_of``); the learner spends ``learner_pause_s`` "packing" each bucket after
    its room, one reader ``reader_pause_s`` "reading" each before it asks again."""
    broker, k = BucketBroker(_NO_HUB), key(count=8)
    await broker.readers(k, ["a", "b"])

    async def paced_learner():
        for index in range(k.count):
            if index >= BUCKETS_IN_FLIGHT:
                assert await broker.room(k, index) is None
            await asyncio.sleep(learner_pause_s)
            await broker.offer(k, index, [f"ref{index}"])

    async def asking_reader(worker: str, pause_s: float):
        asked = {i: asyncio.ensure_future(broker.take(k, i, worker, (), 0)) for i in range(2)}
        for index in range(k.count):
            boxed, why = await asked.pop(index)
            assert why is None and boxed == [f"ref{index}"]
            await asyncio.sleep(pause_s)  # reads bucket `index`
            if index + 2 < k.count:
                asked[index + 2] = asyncio.ensure_future(
                    broker.take(k, index + 2, worker, (), index + 1)
                )
        await broker.take(k, k.count, worker)

    await asyncio.gather(paced_learner(), asking_reader("a", 0), asking_reader("b", reader_pause_s))
    return broker.hand_off()


def test_the_hand_off_clock_says_whose_turn_the_time_between_buckets_was():
    slow_learner = run(_paced_stream(learner_pause_s=0.05, reader_pause_s=0))
    slow_reader = run(_paced_stream(learner_pause_s=0, reader_pause_s=0.05))
    assert slow_learner.buckets == slow_reader.buckets == 8
    # Each turn is measured between the broker's own calls, around the 0.05 s pause: a
    # hair under it was seen (0.0499 s, a reader's turn, the unit tests on a busy machine).
    paused = 0.045
    # A slow pack: the learner's turn is the period; readers wait for each bucket.
    assert slow_learner.learner_turn_s >= paused > slow_learner.readers_turn_s
    assert slow_learner.period_s >= paused and slow_learner.take_wait_s >= 0.04
    # A slow reader: its turn (the rest of its read, then its next take) is the period;
    # the learner waits for room.
    assert slow_reader.readers_turn_s >= paused > slow_reader.learner_turn_s
    assert slow_reader.period_s >= paused and slow_reader.room_wait_s >= 0.04


def test_the_broker_keeps_the_clocks_of_its_last_streams_only():
    async def main():
        broker = BucketBroker(_NO_HUB)
        for number in range(bucket_broker._CLOCKS_KEPT + 1):
            k = StreamId(f"s{number}", 1, 5.0)
            await broker.readers(k, ["a"])
            await broker.offer(k, 0, ["ref0"])
            assert await broker.take(k, 0, "a") == (["ref0"], None)
            await broker.take(k, 1, "a")
        return broker

    broker = run(main())
    assert broker.hand_off("s0") is None
    assert broker.hand_off(f"s{bucket_broker._CLOCKS_KEPT}") == broker.hand_off()
    assert broker.hand_off().buckets == 1


def test_a_bucket_offered_after_the_next_one_is_waited_for_not_called_gone():
    """Ray may start the learner's offers out of order (an async actor): bucket 1's
    before bucket 0's. A reader asking for bucket 0 in between waits for it (it was told
    the bucket was gone, as if every reader had taken it, and failed the version)."""

    async def main():
        broker, k = BucketBroker(_NO_HUB), key(count=3)
        await broker.readers(k, ["a"])
        await broker.offer(k, 1, ["ref1"])
        first = asyncio.ensure_future(broker.take(k, 0, "a"))
        await asyncio.sleep(0)  # the take runs up to its wait for bucket 0
        assert not first.done()
        await broker.offer(k, 0, ["ref0"])
        return await first, await broker.take(k, 1, "a")

    assert run(main()) == ((["ref0"], None), (["ref1"], None))


def test_a_stream_clock_holds_a_few_stamps_per_reader_not_one_per_bucket_read():
    """A 70B bf16 model in 64 MiB buckets is ~2,100 buckets: the clock of a stream to
    many readers kept two stamps per reader and bucket in dicts (~270k entries for 64
    readers, gigabytes at 1,000, for each of the last streams). Per reader it keeps its
    takes not yet answered and its last answer; each wait is one float."""
    readers, buckets = 200, 500
    workers = [f"reader-{i}" for i in range(readers)]
    tracemalloc.start()
    try:
        clock = HandOffClock()
        for worker in workers:  # each asks for the first two buckets at once
            clock.take(worker, 0)
            clock.take(worker, 1)
        for index in range(buckets):
            clock.offer(index)
            for worker in workers:
                clock.answer(worker, index)
                clock.take(worker, index + 2)  # asks two ahead, as readers do
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 100k answered takes: 0.8 MB of waits, a few KB per reader and per bucket.
    assert held < 2 * 2**20, f"{held / 2**20:.1f} MiB held for {readers * buckets} takes"
    summary = clock.summary()
    assert summary.buckets == buckets
    # Every reader asked for bucket k before bucket k - 1 was answered: negative turns.
    assert summary.readers_turn_s < 0 <= summary.take_wait_s


def test_a_reader_registered_again_reads_a_stream_opened_before_it_was_dropped():
    """A version's stream opened ahead (pipelined broadcasts) while its reader died and
    Ray restarted it under the same worker id: the hub plans the version for the new
    process, which was refused every bucket as dropped. One whose earlier process began
    reading a stream stays out of that one (its buckets may be gone)."""

    async def main():
        broker, ahead, begun = BucketBroker(_NO_HUB), key(count=3), StreamId("b", 3, 5.0)
        await broker.readers(begun, ["r"])
        await broker.offer(begun, 0, ["b0"])
        assert (await broker.take(begun, 0, "r"))[1] is None
        await broker.offer(ahead, 0, ["ref0"])  # opened by the learner, not planned yet
        await broker.drop_reader("r")
        await broker.readmit("r")  # the new process registered
        await broker.readers(ahead, ["r"])
        log: list = []
        got = await asyncio.gather(
            learner_from(broker, ahead, 1, log), reader(broker, ahead, "r", log)
        )
        return got[1], await broker.take(begun, 1, "r")

    got, (boxed, why) = run(main())
    assert got == [f"ref{i}" for i in range(3)]
    assert boxed is None and "dropped from the stream: the hub dropped it" in why


async def learner_from(broker: BucketBroker, k: StreamId, first: int, log: list) -> None:
    """:func:`learner` from bucket ``first`` on (those before it offered already)."""
    for index in range(first, k.count):
        if index >= BUCKETS_IN_FLIGHT:
            why = await broker.room(k, index)
            assert why is None, why
        await broker.offer(k, index, [f"ref{index}"])


def test_a_stream_ended_again_after_it_was_read_whole_keeps_who_read_it():
    """A refused version's planner ends its stream, as may a second planner reading the
    same hand-off: an end that comes after the stream ended must not wipe who read it
    whole (they serve it to late joiners)."""

    async def main():
        broker, k, log = BucketBroker(_NO_HUB), key(count=2), []
        await broker.readers(k, ["a"])
        await asyncio.gather(reader(broker, k, "a", log), learner(broker, k, log))
        await broker.end(k, "the hub refused this version")
        return broker.finished(k)

    assert run(main()) == ["a"]


def test_a_served_stream_that_stalls_names_the_receiver_serving_it_not_the_learner():
    async def main():
        broker = BucketBroker(_NO_HUB)
        served = StreamId("s", 2, 0.05, served=True)
        await broker.readers(served, ["joiner"])
        return await broker.take(served, 0, "joiner")

    boxed, why = run(main())
    assert boxed is None
    assert why == (
        "bucket 0 of 2 did not arrive within 0.05 s (the receiver serving it may have "
        "died or stalled)"
    )


def test_who_read_a_models_latest_version_is_remembered_however_many_streams_end_after():
    """A reference model broadcast once, a policy every step: after a few hundred of the
    policy's streams ended, the broker had forgotten who read the reference whole, so a
    late joiner of it was served nobody's copy and waited out its timeout."""

    async def main():
        broker, k, log = BucketBroker(_NO_HUB), key(count=2), []
        broker.latest("reference", [k])
        await broker.readers(k, ["a"])
        await asyncio.gather(reader(broker, k, "a", log), learner(broker, k, log))
        for n in range(2 * bucket_broker._ENDED_KEPT):
            policy = StreamId(f"policy{n}", 2, 5.0)
            broker.latest("policy", [policy])
            await broker.end(policy, "done")
        return broker.finished(k), len(broker._ended)

    finished, remembered = run(main())
    assert finished == ["a"]
    assert remembered <= bucket_broker._ENDED_KEPT + 1  # the others are still forgotten


def test_a_joiner_waits_for_the_first_reader_to_take_a_running_version_whole():
    """A receiver that joins while a version streams is none of its readers: its
    buckets are theirs. The planner asks who can serve it, and hears once the first
    reader took every bucket (a version streamed back to back with the next one always
    runs when a receiver joins: answered at once, nobody held it yet)."""

    async def main():
        broker, k, log = BucketBroker(_NO_HUB), key(count=3), []
        await broker.readers(k, ["a"])
        await broker.offer(k, 0, ["ref0"])  # the stream runs, nobody read it whole
        asked = asyncio.ensure_future(broker.holders(k, "late"))
        await asyncio.sleep(0)
        waited = not asked.done()
        await asyncio.gather(reader(broker, k, "a", log), learner_from(broker, k, 1, log))
        return waited, await asked

    assert run(main()) == (True, ["a"])


def test_a_reader_reads_the_running_stream_and_a_joiner_of_an_ended_one_hears_who_read_it():
    """A restarted process taken in again as a reader (its worker id is named) reads the
    version's own stream: ``None``, at once. Once the stream ended, its readers that
    took it whole are named at once; a stream that ended with nobody holding it names
    nobody (the joiner's read says the buckets are gone)."""

    async def main():
        broker, k, log = BucketBroker(_NO_HUB), key(count=2), []
        await broker.readers(k, ["a", "b"])
        as_reader = await broker.holders(k, "b")
        await asyncio.gather(
            reader(broker, k, "a", log), reader(broker, k, "b", log), learner(broker, k, log)
        )
        after = await broker.holders(k, "late")
        cut = StreamId("cut", 2, 5.0)
        await broker.readers(cut, ["a"])
        await broker.end(cut, "the learner died")
        return as_reader, after, await broker.holders(cut, "late")

    assert run(main()) == (None, ["a", "b"], [])


def test_a_joiner_of_a_stream_nobody_finishes_hears_nobody_after_its_wait():
    async def main():
        broker, k = BucketBroker(_NO_HUB), key(count=3, wait_s=0.05)
        await broker.readers(k, ["a"])
        return await broker.holders(k, "late")

    assert run(main()) == []

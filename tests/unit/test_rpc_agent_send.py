"""The RPC agent's send path and member list without Ray or an RPC group: torch's calls are
stubbed, its store is an in-process HashStore.

A receiver that was just admitted, or that is moving to a new agent's group, may still be
joining when its version is sent; torch then refuses the send for a moment even after it
knows the receiver's name ("could not find destination url"). The agent must retry the
send until its timeout, not lose the version.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed.rpc as rpc

from raysync.actors import rpc_agent
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError
from raysync.transports.object_store.arrays import object_of
from raysync.transports.object_store.bucket_stream import BucketStream, StreamId
from raysync.transports.object_store.wire import ObjectStorePayload
from raysync.transports.options import RpcOptions
from raysync.transports.rpc import (
    RpcJob,
    abandon_bucketed,
    abandon_whole,
    land,
    land_bucket,
    rpc_name,
)
from raysync.transports.rpc import receiver as receiver_inbox

pytestmark = pytest.mark.skipif(not rpc.is_available(), reason="no torch.distributed.rpc")

KEY = "k" * 32


def _agent(monkeypatch, timeout_s: float, members: int = 1) -> rpc_agent.RpcAgentActor:
    """An agent whose group has ``members`` members, ``w0`` at rank 1, ``w1`` at rank 2
    and so on; no store, no RPC agent."""
    monkeypatch.setattr(rpc_agent, "node_ip", lambda: "127.0.0.1")
    monkeypatch.setattr(rpc_agent, "open_master_store", lambda host, t: ("raysync-rpc://x", None))
    monkeypatch.setattr(rpc_agent, "init_rpc", lambda name, rank, url, settings: None)
    known = {f"w{i}": (f"p{i}", i + 1) for i in range(members)}
    return rpc_agent.RpcAgentActor(KEY, "hub", RpcOptions(timeout_s=timeout_s), known)


def _send(agent: rpc_agent.RpcAgentActor, weights: list[np.ndarray]):
    async def run():
        ref = asyncio.get_running_loop().create_future()  # stands in for the learner's copy
        ref.set_result(object_of(weights))
        spec = WeightSpec.of({"w": torch.from_numpy(weights[0])})
        job = RpcJob(1, "policy", 1, ("w0",), ObjectStorePayload((ref,)), spec)
        return await agent.send(job), await agent.describe()

    return asyncio.run(run())


def _joining(refusals: int, calls: list):
    """``rpc_async`` as torch answers it while the receiver's join reaches the agent: the
    first ``refusals`` calls raise (the name is known, the address not yet)."""

    def rpc_async(to, func, args, timeout):
        calls.append((to, func, args))
        if len(calls) <= refusals:
            raise RuntimeError(
                f"name:{rpc_name(KEY, 0)},rank:0 could not find destination url for name {to}"
            )
        future = torch.futures.Future()
        future.set_result(args[1])
        return future

    return rpc_async


def test_a_receiver_still_joining_gets_its_version_once_it_can_be_reached(monkeypatch):
    agent = _agent(monkeypatch, timeout_s=10)
    calls: list = []
    monkeypatch.setattr(rpc, "rpc_async", _joining(refusals=3, calls=calls))
    weights = [np.arange(6, dtype=np.float32)]

    outcomes, status = _send(agent, weights)

    assert outcomes == {"w0": None}
    assert status.sent == 1 and status.failures == ()
    assert len(calls) == 4
    to, func, (key, seq, tensors, model) = calls[-1]
    assert (to, func, key, seq, model) == (rpc_name(KEY, 1), land, KEY, 1, "policy")
    assert torch.equal(tensors[0], torch.from_numpy(weights[0]))


def test_a_receiver_that_never_becomes_reachable_fails_at_the_timeout(monkeypatch):
    agent = _agent(monkeypatch, timeout_s=0.3)
    monkeypatch.setattr(rpc, "rpc_async", _joining(refusals=10**9, calls=[]))

    outcomes, status = _send(agent, [np.zeros(2, dtype=np.float32)])

    assert "could not find destination url" in outcomes["w0"]
    assert status.sent == 0 and len(status.failures) == 1


def test_a_receiver_no_send_reached_is_tried_briefly_until_one_does(monkeypatch):
    """Once a send gave up reaching a receiver (a whole timeout), the next ones try it
    for a moment only: each held one of the agent's threads for the whole timeout, and
    a few broadcasts in flight took them all. Once a call to it goes out, it is given
    the whole timeout again."""
    monkeypatch.setattr(rpc_agent, "_UNREACHED_RETRY_S", 0.0)
    agent = _agent(monkeypatch, timeout_s=0.3)
    calls: list = []
    monkeypatch.setattr(rpc, "rpc_async", _joining(refusals=10**9, calls=calls))

    def lands() -> int:
        return sum(func is land for _, func, _ in calls)

    first, _ = _send(agent, [np.zeros(2, dtype=np.float32)])
    tries = lands()
    second, _ = _send(agent, [np.zeros(2, dtype=np.float32)])
    assert "within 0.3 s:" in first["w0"] and tries > 1
    assert "within 0 s (nor could the send before)" in second["w0"]
    assert lands() == tries + 1  # tried once: its short window had passed
    monkeypatch.setattr(rpc, "rpc_async", _joining(refusals=0, calls=calls))
    assert _send(agent, [np.zeros(2, dtype=np.float32)])[0] == {"w0": None}
    monkeypatch.setattr(rpc, "rpc_async", _joining(refusals=10**9, calls=calls))
    assert "within 0.3 s:" in _send(agent, [np.zeros(2, dtype=np.float32)])[0]["w0"]


def test_a_receivers_new_process_gets_a_sends_whole_time_to_become_reachable(monkeypatch):
    """No send reached w0's process for a whole timeout; Ray restarted it and the new
    process was admitted. The next send tried it for the short window kept for the
    unreachable, while it was still joining, and failed it naming a send before that
    never went to this process."""
    monkeypatch.setattr(rpc_agent, "_UNREACHED_RETRY_S", 0.0)
    agent = _agent(monkeypatch, timeout_s=0.3)
    monkeypatch.setattr(agent, "_unlist", lambda names: set())  # no store here
    monkeypatch.setattr(agent, "_prune", lambda: None)  # nor an RPC group to ping
    monkeypatch.setattr(rpc, "rpc_async", _joining(refusals=10**9, calls=[]))
    assert "within 0.3 s:" in _send(agent, [np.zeros(2, dtype=np.float32)])[0]["w0"]
    asyncio.run(agent.admit("w0", "p-restarted"))
    monkeypatch.setattr(rpc, "rpc_async", _joining(refusals=3, calls=[]))  # joining yet
    assert _send(agent, [np.zeros(2, dtype=np.float32)])[0] == {"w0": None}


def test_a_send_that_gives_up_on_a_former_process_leaves_the_new_one_its_whole_time(
    monkeypatch,
):
    """The send started to w0's former process; Ray restarted it and the new process
    was admitted while that send still tried; it gave up at its deadline and marked w0
    unreachable: the next send gave the new process, still joining, the short window."""
    monkeypatch.setattr(rpc_agent, "_UNREACHED_RETRY_S", 0.0)
    agent = _agent(monkeypatch, timeout_s=0.3)
    monkeypatch.setattr(agent, "_unlist", lambda names: set())  # no store here
    monkeypatch.setattr(agent, "_prune", lambda: None)  # nor an RPC group to ping
    refused = _joining(refusals=10**9, calls=[])
    admitted: list[object] = []

    def refusing_while_admitted(to, func, args, timeout):
        if not admitted:  # the restarted process is admitted while this send tries
            admitted.append(asyncio.run(agent.admit("w0", "p-restarted")))
        return refused(to, func, args, timeout)

    monkeypatch.setattr(rpc, "rpc_async", refusing_while_admitted)
    assert "within 0.3 s:" in _send(agent, [np.zeros(2, dtype=np.float32)])[0]["w0"]
    monkeypatch.setattr(rpc, "rpc_async", _joining(refusals=3, calls=[]))  # joining yet
    assert _send(agent, [np.zeros(2, dtype=np.float32)])[0] == {"w0": None}


def _failed_now(why: str) -> torch.futures.Future:
    """A future that failed as torch's own do (an error, not a value raised on wait)."""
    source = torch.futures.Future()

    def fail(_):
        raise RuntimeError(why)

    failed = source.then(fail)
    source.set_result(None)
    return failed


def test_a_bucket_call_refused_at_once_does_not_cut_the_others_short(monkeypatch):
    """A dead receiver's call fails at once (its connection is refused) while the other
    receiver's is still on its way: the other must get the time to finish, not be
    counted as stalled (``collect_all`` completes at the first error)."""
    agent = _agent(monkeypatch, timeout_s=10, members=2)
    dead = rpc_name(KEY, 1)  # w0; w1 is rank 2
    timers: list[threading.Timer] = []

    def rpc_async(to, func, args, timeout):
        if to == dead:
            return _failed_now("connection refused")
        landing = torch.futures.Future()
        timers.append(threading.Timer(0.2, landing.set_result, (args[1],)))
        timers[-1].start()
        return landing

    monkeypatch.setattr(rpc, "rpc_async", rpc_async)

    outcomes = asyncio.run(
        agent._call_each(["w0", "w1"], land_bucket, (KEY, 1, 8, (), []), stall_s=5.0)
    )

    assert outcomes["w1"] is None, outcomes["w1"]
    assert "connection refused" in outcomes["w0"]
    for timer in timers:
        timer.join()


def test_a_bucket_call_that_cannot_be_made_gives_up_at_the_stall_limit(monkeypatch):
    """A receiver torch cannot reach (admitted, never joined) is tried again until the
    bucket's stall limit, not the RPC timeout: the others wait for the next bucket
    only as long as the timeout from the last one, and a bucket held back that long
    failed them all."""
    agent = _agent(monkeypatch, timeout_s=3, members=2)
    unreachable = rpc_name(KEY, 1)  # w0; w1 is rank 2

    def rpc_async(to, func, args, timeout):
        if to == unreachable:
            raise RuntimeError(f"could not find destination url for name {to}")
        landed = torch.futures.Future()
        landed.set_result(args[1])
        return landed

    monkeypatch.setattr(rpc, "rpc_async", rpc_async)

    outcomes = asyncio.run(
        agent._call_each(["w0", "w1"], land_bucket, (KEY, 1, 8, (), []), stall_s=0.2)
    )

    assert outcomes["w1"] is None
    assert "within 0.2 s: could not find destination url" in outcomes["w0"], outcomes["w0"]


def test_a_receiver_dropped_from_a_bucketed_version_is_told_why(monkeypatch):
    """A receiver whose bucket call stalls (a busy process) gets no more buckets of the
    version; it is told so at once, with the agent's reason, rather than waiting the
    whole timeout for a bucket that will not come and failing with a guess."""
    agent = _agent(monkeypatch, timeout_s=0.4, members=2)
    stalled = rpc_name(KEY, 1)  # w0; w1 is rank 2
    calls: list = []

    def rpc_async(to, func, args, timeout):
        calls.append((to, func, args))
        future = torch.futures.Future()
        if to != stalled or func is not land_bucket:
            future.set_result(None)
        return future  # w0's bucket never lands

    monkeypatch.setattr(rpc, "rpc_async", rpc_async)
    seq = 7

    dropped = asyncio.run(agent._land_bucket(["w0", "w1"], (KEY, seq, 8, (), []), 0.2))

    assert list(dropped) == ["w0"] and "not done within 0.2 s" in dropped["w0"]
    told = [(to, args) for to, func, args in calls if func is abandon_bucketed]
    assert told == [(stalled, (KEY, seq, f"the RPC agent gave it up: {dropped['w0']}"))]
    receiver_inbox._BUCKETS.opened()  # w0's receiver
    try:
        abandon_bucketed(*told[0][1])  # as it runs on w0's RPC thread pool: its fetch fails now
        with pytest.raises(TransportError, match="gave it up: RPC to w0 not done within 0.2 s"):
            receiver_inbox._BUCKETS.take(KEY, seq, count=2, timeout_s=30)
    finally:
        receiver_inbox._BUCKETS.closed()


def _whole(agent: rpc_agent.RpcAgentActor, seq: int, copy: Exception | None):
    """The agent's send of whole version #``seq`` to w0 and w1: the learner's copy is
    read, or raises ``copy``."""

    async def run():
        ref = asyncio.get_running_loop().create_future()  # stands in for the learner's copy
        weights = [np.arange(4, dtype=np.float32)]
        if copy is None:
            ref.set_result(object_of(weights))
        else:
            ref.set_exception(copy)
        spec = WeightSpec.of({"w": torch.from_numpy(weights[0])})
        job = RpcJob(seq, "policy", seq, ("w0", "w1"), ObjectStorePayload((ref,)), spec)
        return await agent.send(job)

    return asyncio.run(run())


def _recording(calls: list, failing: str | None = None):
    """``rpc_async`` that records each call; the one to ``failing`` fails as torch's do."""

    def rpc_async(to, func, args, timeout):
        calls.append((to, func, args))
        if to == failing and func is land:
            return _failed_now("connection reset by peer")
        done = torch.futures.Future()
        done.set_result(None)
        return done

    return rpc_async


def test_receivers_of_a_version_the_agent_cannot_read_are_told_why_at_once(monkeypatch):
    """The learner's copy is gone (its process died): each receiver's fetch fails at once
    with that reason, not after its timeout with a guess ("did not land ... the RPC
    agent may have died")."""
    agent = _agent(monkeypatch, timeout_s=10, members=2)
    calls: list = []
    monkeypatch.setattr(rpc, "rpc_async", _recording(calls))

    outcomes = _whole(agent, 21, copy=RuntimeError("the learner's object is lost"))

    assert all("could not read the update" in why for why in outcomes.values()), outcomes
    told = {to: args for to, func, args in calls if func is abandon_whole}
    assert told == {
        rpc_name(KEY, 1): (KEY, 21, outcomes["w0"]),
        rpc_name(KEY, 2): (KEY, 21, outcomes["w1"]),
    }
    assert not [call for call in calls if call[1] is land]
    receiver_inbox._INBOX.opened()  # w0's receiver
    try:
        abandon_whole(*told[rpc_name(KEY, 1)])  # as it runs on w0's RPC thread pool
        with pytest.raises(TransportError, match="could not read the update.*object is lost"):
            receiver_inbox._INBOX.take(KEY, 21, timeout_s=30)
    finally:
        receiver_inbox._INBOX.closed()


def test_a_receiver_whose_version_failed_to_land_is_told_why_at_once(monkeypatch):
    """Its RPC failed (the connection broke): it hears the agent's reason at once; the
    receiver whose RPC landed is not told anything."""
    agent = _agent(monkeypatch, timeout_s=10, members=2)
    calls: list = []
    monkeypatch.setattr(rpc, "rpc_async", _recording(calls, failing=rpc_name(KEY, 1)))

    outcomes = _whole(agent, 22, copy=None)

    assert outcomes["w1"] is None and "connection reset by peer" in outcomes["w0"]
    told = [(to, args) for to, func, args in calls if func is abandon_whole]
    assert told == [(rpc_name(KEY, 1), (KEY, 22, outcomes["w0"]))]
    receiver_inbox._INBOX.opened()  # w0's receiver
    try:
        abandon_whole(*told[0][1])
        with pytest.raises(TransportError, match="connection reset by peer"):
            receiver_inbox._INBOX.take(KEY, 22, timeout_s=30)
    finally:
        receiver_inbox._INBOX.closed()


@pytest.mark.parametrize("joined", [True, False])
def test_a_process_that_left_is_listed_again_only_if_it_had_joined(monkeypatch, joined):
    """w0's process left the hub and registered again. One that had joined the group
    lives on in it under its name: it is listed again. One whose join failed (torch
    took its name off the list as it gave up) was listed again all the same, and its
    next ``init_rpc`` was refused as a name not unique, at every try: the receiver
    never joined again. It joins anew, under the same rank."""
    from torch.distributed import HashStore

    from raysync.transports.rpc import MEMBER_LIST_KEY

    agent = _agent(monkeypatch, timeout_s=5.0)
    store = HashStore()
    monkeypatch.setattr(agent, "_group_store", lambda: store)
    entry = f"{rpc_name(KEY, 1)}-1"  # w0, rank 1
    store.set(MEMBER_LIST_KEY, f"{entry}," if joined else "")

    async def run() -> rpc_agent.RpcMember:
        await agent.forget("w0")
        assert agent._listed() == []
        return await agent.admit("w0", "p0")  # the same process registers again

    member = asyncio.run(run())
    assert (member.name, member.rank) == (rpc_name(KEY, 1), 1)
    assert agent._listed() == ([entry] if joined else [])


def test_the_agents_own_edits_of_the_member_list_take_turns(monkeypatch):
    """The join token an edit takes is the same for each of the agent's edits: a second
    edit (a call the planner gave up on still ran beside the next) found the token
    its own and rewrote the list beside the first; the first's end then gave the
    token back while the second still wrote."""
    from torch.distributed import HashStore

    agent = _agent(monkeypatch, timeout_s=5.0)
    store = HashStore()
    monkeypatch.setattr(agent, "_group_store", lambda: store)
    first_in, first_go, second_in = threading.Event(), threading.Event(), threading.Event()

    def first(listed: list[str]) -> list[str]:
        first_in.set()
        assert first_go.wait(timeout=30)
        return [*listed, "a-1"]

    def second(listed: list[str]) -> list[str]:
        second_in.set()
        return [*listed, "b-2"]

    editing = threading.Thread(target=agent._edit_list, args=(set(), first))
    editing.start()
    assert first_in.wait(timeout=30)
    other = threading.Thread(target=agent._edit_list, args=(set(), second))
    other.start()
    overlapped = second_in.wait(timeout=0.5)  # it runs at once when nothing stops it
    first_go.set()
    editing.join(timeout=30)
    other.join(timeout=30)
    assert not overlapped
    assert agent._listed() == ["a-1", "b-2"]


@pytest.mark.parametrize("held_during", ["forget", "admit"])
def test_an_edit_of_the_member_list_that_timed_out_keeps_the_process_its_rank(
    monkeypatch, held_during
):
    """A joiner held the join token past the agent's timeout (it waits out its own
    failed join): the edit raised, and the agent had already let go of its record of
    the process (forget took it off the members first, admit took its place off the
    books first). Attached again, the live process was given a fresh rank, which its
    torch RPC, alive under the old one, refuses at every try."""
    from torch.distributed import HashStore

    from raysync.transports.rpc import JOIN_TOKEN_KEY, MEMBER_LIST_KEY

    agent = _agent(monkeypatch, timeout_s=0.3)
    monkeypatch.setattr(agent, "_prune", lambda: None)
    store = HashStore()
    monkeypatch.setattr(agent, "_group_store", lambda: store)
    store.set(MEMBER_LIST_KEY, f"{rpc_name(KEY, 1)}-1,")  # w0 joined, rank 1
    joiner = "Token_for_joiner_join"

    async def run() -> rpc_agent.RpcMember:
        if held_during == "forget":
            store.set(JOIN_TOKEN_KEY, joiner)
            with pytest.raises(TimeoutError):
                await agent.forget("w0")
        else:
            await agent.forget("w0")
            store.set(JOIN_TOKEN_KEY, joiner)
            with pytest.raises(TimeoutError):
                await agent.admit("w0", "p0")
        store.set(JOIN_TOKEN_KEY, "")  # the joiner gave it back
        return await agent.admit("w0", "p0")  # the same process attaches again

    member = asyncio.run(run())
    assert member.rank == 1


@pytest.mark.parametrize(("timeout_s", "wait_s", "limit_s"), [(30.0, 4.0, 1.0), (2.0, 60.0, 1.0)])
def test_a_bucket_call_is_waited_for_half_the_timeout_or_half_the_stall_if_shorter(
    monkeypatch, timeout_s, wait_s, limit_s
):
    """The agent is its stream's one reader, and the broker drops a reader that long
    (the stall: half the broadcast's timeout) behind: waiting half the agent's timeout
    for a stalled receiver (15 s by default) beside a broadcast of 20 s, the agent was
    dropped, and every receiver of the version failed, not the stalled one alone."""
    agent = _agent(monkeypatch, timeout_s=timeout_s, members=2)
    limits: list[float] = []

    async def land(workers, args, limit):
        limits.append(limit)
        return {}

    async def one_bucket(plan, reader, timeout):
        yield SimpleNamespace(pieces=()), []

    monkeypatch.setattr(agent, "_land_bucket", land)
    monkeypatch.setattr(rpc_agent, "read_buckets", one_bucket)
    monkeypatch.setattr(rpc_agent, "relay_plan", lambda source, spec: None)
    monkeypatch.setattr(rpc_agent, "finish", lambda source, reader, live: None)
    source = BucketStream(object(), StreamId("s", 4, wait_s), 64)
    spec = WeightSpec.of({"w": torch.zeros(4)})
    job = rpc_agent.RpcJob(1, "policy", 1, ("w0", "w1"), source, spec)
    asyncio.run(agent._send_buckets(job))
    assert limits == [limit_s]

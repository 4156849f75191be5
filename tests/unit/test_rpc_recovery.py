"""The RPC transport recovering, without Ray: the planner keeps an agent that is out
of reach for a moment and replaces a dead one (raysync/transports/rpc/planner.py); a
receiver whose first join failed joins again where the agent looks for it
(raysync/transports/rpc/receiver.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from raysync.transports.base import TransportError
from raysync.transports.rpc.planner import RpcPlanner


@pytest.fixture(autouse=True)
def _no_receiver_attached(monkeypatch):
    """Each test's process starts with no receiver open (some join without one, which
    counts its worker attached for good)."""
    from raysync.transports.rpc import receiver

    monkeypatch.setattr(receiver._Membership, "attached", receiver._Attached())


class _Agent:
    """Stands for the agent's actor handle: ``ping`` raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.ping = self
        self.members = self

    async def _raise(self) -> None:
        raise self.error

    def remote(self):
        return self._raise()


def _planner(agent: _Agent) -> RpcPlanner:
    planner = RpcPlanner.__new__(RpcPlanner)  # its agent, without starting one
    planner._name, planner._key, planner._actor = "agent", "k1", agent
    planner._members_of, planner._broker = "k1", None
    planner._start_agent = lambda: ("k2", _Agent(ActorDiedError()))
    return planner


def test_an_agent_out_of_reach_for_a_moment_is_kept():
    """Ray says an actor is unavailable while a network blip lasts: replacing it (as a
    dead one) moved every receiver to a new group, and naming a second agent failed."""
    agent = _Agent(ActorUnavailableError("connection to the actor lost", None))
    planner = _planner(agent)
    with pytest.raises(TransportError, match="did not answer now"):
        asyncio.run(planner._live_agent())
    assert (planner._key, planner._actor) == ("k1", agent)


def test_a_dead_agent_is_replaced():
    planner = _planner(_Agent(ActorDiedError()))
    with pytest.raises(TransportError, match="could not start"):  # the stand-in's members
        asyncio.run(planner._live_agent())
    assert planner._key == "k2"


def test_a_first_join_that_failed_is_tried_again_under_the_agents_store_prefix(monkeypatch):
    """torch's init_rpc counts its calls once its store connects, and prefixes the
    store's keys with that count; the agent's process counts its first call. A first
    join that failed after connecting made the next one count 1: it joined a namespace
    of its own, which the agent never read (every version waited its timeout)."""
    import torch.distributed.rpc as rpc

    from raysync.transports.options import RpcOptions
    from raysync.transports.rpc import receiver
    from raysync.transports.rpc.wire import RpcMember

    prefixes: list[int] = []

    def init_rpc(name, rank, url, settings):
        with rpc._init_counter_lock:
            prefixes.append(rpc._init_counter)
            rpc._init_counter += 1  # connected: counted, whatever follows
        if len(prefixes) == 1:
            raise RuntimeError("the join failed after its store connected (injected)")

    monkeypatch.setattr(receiver, "init_rpc", init_rpc)
    monkeypatch.setattr(receiver._Membership, "member", None)
    monkeypatch.setattr(receiver._Membership, "rank", None)
    monkeypatch.setattr(rpc, "_init_counter", 0)
    member = RpcMember("raysync-rpc://h:1/p", "k1", "hub", "raysync_k1_1", 1, RpcOptions(), "w")
    with pytest.raises(RuntimeError, match="injected"):
        receiver._Membership.join(member)
    assert receiver._Membership.join(member) == member
    assert prefixes == [0, 0]


def test_a_late_delivery_of_a_group_left_does_not_move_the_receiver_back(monkeypatch):
    """The agent was replaced and this process moved to the new group; a delivery of
    the old group that runs after (threads, another model's queue) moved it back into
    the dead group, joining a store nobody serves for its whole timeout."""
    import torch.distributed.rpc as rpc

    from raysync.transports.options import RpcOptions
    from raysync.transports.rpc import receiver
    from raysync.transports.rpc.wire import RpcMember

    joined: list[str] = []
    monkeypatch.setattr(receiver, "init_rpc", lambda name, rank, url, settings: joined.append(url))
    monkeypatch.setattr(rpc, "shutdown", lambda graceful: None)
    monkeypatch.setattr(receiver._Membership, "member", None)
    monkeypatch.setattr(receiver._Membership, "rank", None)
    monkeypatch.setattr(receiver._Membership, "left", set())
    old, new = (
        RpcMember(f"raysync-rpc://h:1/{key}", key, "hub", f"raysync_{key}_1", 1, RpcOptions(), "w")
        for key in ("k1", "k2")
    )
    receiver._Membership.join(old)
    receiver._Membership.follow(new)  # the agent was replaced: moved
    with pytest.raises(TransportError, match="RPC group this process has left"):
        receiver._Membership.follow(old)
    assert joined == [old.url, new.url] and receiver._Membership.member == new


def test_a_second_receiver_of_the_hub_in_a_process_is_refused_saying_why(monkeypatch):
    """A process in the hub's RPC group attached a second receiver under another worker
    id: the hub admitted it under a new name, which torch RPC cannot give one process.
    The refusal said only that the names differed."""
    from raysync.transports.options import RpcOptions
    from raysync.transports.rpc import receiver
    from raysync.transports.rpc.wire import RpcMember

    first = RpcMember("raysync-rpc://h:1/p", "k1", "hub", "raysync_k1_1", 1, RpcOptions(), "a")
    second = dataclasses.replace(first, name="raysync_k1_2", rank=2, worker="b")
    monkeypatch.setattr(receiver, "init_rpc", lambda name, rank, url, settings: None)
    monkeypatch.setattr(receiver._Membership, "member", None)
    monkeypatch.setattr(receiver._Membership, "rank", None)
    monkeypatch.setattr(receiver, "_INBOX", receiver._Inbox())
    monkeypatch.setattr(receiver, "_BUCKETS", receiver._BucketInbox())
    opened = receiver.RpcReceiver(first)  # receiver 'a' stays open
    try:
        with pytest.raises(TransportError, match=r"receiver 'a'.*receiver 'b'.*in one receiver"):
            receiver.RpcReceiver(second)
        assert receiver._Membership.member == first
    finally:
        opened.close()


def test_a_version_that_lands_while_the_receiver_joins_is_kept(monkeypatch):
    """torch's dynamic join lets the agent reach a process inside its ``init_rpc``: the
    agent's send to a restarted receiver may land before the receiver is made. The inbox
    was opened only after the join, kept nothing before, and the version's delivery
    waited out its whole timeout."""
    import torch

    from raysync.transports.options import RpcOptions
    from raysync.transports.rpc import receiver
    from raysync.transports.rpc.wire import RpcMember

    member = RpcMember("raysync-rpc://h:1/p", "k1", "hub", "raysync_k1_1", 1, RpcOptions(), "w")

    def init_rpc(name, rank, url, settings):  # the agent's send arrives mid-join
        receiver.land(member.key, 1, [torch.ones(2)], "m")
        receiver.land_bucket(member.key, 2, 8, [(0, 8)], [torch.ones(8, dtype=torch.uint8)], "m")

    monkeypatch.setattr(receiver, "init_rpc", init_rpc)
    monkeypatch.setattr(receiver._Membership, "member", None)
    monkeypatch.setattr(receiver._Membership, "rank", None)
    monkeypatch.setattr(receiver, "_INBOX", receiver._Inbox())
    monkeypatch.setattr(receiver, "_BUCKETS", receiver._BucketInbox())
    rpc_receiver = receiver.RpcReceiver(member)
    try:
        assert torch.equal(receiver._INBOX.take("k1", 1, timeout_s=0.3)[0], torch.ones(2))
        assert receiver._BUCKETS.take("k1", 2, count=1, timeout_s=0.3).numel() == 8
    finally:
        rpc_receiver.close()


def test_a_receiver_whose_join_failed_keeps_nothing_landing(monkeypatch):
    from raysync.transports.options import RpcOptions
    from raysync.transports.rpc import receiver
    from raysync.transports.rpc.wire import RpcMember

    def init_rpc(name, rank, url, settings):
        raise RuntimeError("the join failed (injected)")

    monkeypatch.setattr(receiver, "init_rpc", init_rpc)
    monkeypatch.setattr(receiver._Membership, "member", None)
    monkeypatch.setattr(receiver._Membership, "rank", None)
    monkeypatch.setattr(receiver, "_INBOX", receiver._Inbox())
    monkeypatch.setattr(receiver, "_BUCKETS", receiver._BucketInbox())
    member = RpcMember("raysync-rpc://h:1/p", "k1", "hub", "raysync_k1_1", 1, RpcOptions(), "w")
    with pytest.raises(RuntimeError, match="injected"):
        receiver.RpcReceiver(member)
    assert receiver._INBOX._receivers == 0 and receiver._BUCKETS._receivers == 0


class _Admitting:
    """Stands for the agent's handle: ``ping`` answers, ``admit`` admits at once, and a
    ``forget`` waits (as one waiting for the group's join token) until ``forgotten``."""

    def __init__(self) -> None:
        self.forgotten = asyncio.Event()
        self.ping = _Call(lambda: None)
        self.admit = _Call(lambda worker, process: SimpleNamespace(worker=worker, rank=1))
        self.forget = _Call(lambda worker: self.forgotten.wait())


class _Call:
    def __init__(self, fn) -> None:
        self._fn = fn

    def remote(self, *args):
        async def call():
            result = self._fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return call()


class _Ranks:
    """Stands for the planner's rank book (the GCS's): worker -> process."""

    def __init__(self, processes: dict[str, str]) -> None:
        self.processes = processes

    def remove(self, worker: str) -> str | None:
        return self.processes.pop(worker, None)

    def set(self, worker: str, process: str, rank: int) -> None:
        self.processes[worker] = process


def _admitting_planner(agent: _Admitting, processes: dict[str, str]) -> RpcPlanner:
    planner = RpcPlanner.__new__(RpcPlanner)
    planner._name, planner._key, planner._actor = "agent", "k1", agent
    planner._members_of, planner._broker = "k1", None
    planner._lock, planner._forgetting = asyncio.Lock(), {}
    planner._members, planner._receivers = {}, {}
    planner._ranks = _Ranks(processes)
    return planner


def _info(worker: str, process: str):
    from raysync.transports.base import ReceiverInfo

    return ReceiverInfo(worker, f"A({worker})", "node", process, None)


def test_a_join_waits_only_for_the_forget_of_its_own_process():
    """Another receiver's departure waits in the agent for the group's join token, up to
    the RPC timeout: a join waited for it under the lock every plan takes (every
    broadcast meanwhile failed everyone, "could not plan"). A process that left and
    comes back still waits for its own forget (its place is recorded there)."""

    async def scenario() -> None:
        agent = _Admitting()
        planner = _admitting_planner(agent, {"gone": "p-gone", "back": "p-back"})
        leaving = asyncio.ensure_future(planner.receiver_left("gone"))
        await asyncio.sleep(0)  # its forget is on its way
        member = await asyncio.wait_for(planner.receiver_joined(_info("new", "p-new")), 1)
        assert member.worker == "new"
        returning = asyncio.ensure_future(planner.receiver_left("back"))
        await asyncio.sleep(0)
        rejoining = asyncio.ensure_future(planner.receiver_joined(_info("back", "p-back")))
        for _ in range(20):  # turns of the loop: everything not waiting on the forget ran
            await asyncio.sleep(0)
        assert not rejoining.done()  # its own process's forget runs
        agent.forgotten.set()
        assert (await asyncio.wait_for(rejoining, 1)).worker == "back"
        await asyncio.gather(leaving, returning)

    asyncio.run(scenario())


def test_a_late_delivery_of_a_group_passed_over_does_not_move_the_receiver_there(monkeypatch):
    """Two agents replaced in a row: this process moved from the first group to the
    third, and a delivery planned for the second (dead before it came) ran after. That
    group was not among those it left: it shut the third down, counted it left, and
    tried the dead one; every delivery of the live group was refused from then on."""
    import torch.distributed.rpc as rpc

    from raysync.transports.options import RpcOptions
    from raysync.transports.rpc import receiver
    from raysync.transports.rpc.wire import RpcMember

    joined: list[str] = []
    shut_down: list[bool] = []
    monkeypatch.setattr(receiver, "init_rpc", lambda name, rank, url, settings: joined.append(url))
    monkeypatch.setattr(rpc, "shutdown", lambda graceful: shut_down.append(graceful))
    monkeypatch.setattr(receiver._Membership, "member", None)
    monkeypatch.setattr(receiver._Membership, "rank", None)
    monkeypatch.setattr(receiver._Membership, "left", set())
    monkeypatch.setattr(receiver._Membership, "generation", 0)
    first, second, third = (
        RpcMember(
            f"raysync-rpc://h:1/k{n}", f"k{n}", "hub", f"raysync_k{n}_1", 1, RpcOptions(), "w", n
        )
        for n in (1, 2, 3)
    )
    receiver._Membership.join(first)
    receiver._Membership.follow(third)  # the agent was replaced twice: moved
    with pytest.raises(TransportError, match="RPC group this process has left or passed over"):
        receiver._Membership.follow(second)
    receiver._Membership.follow(third)
    assert (joined, len(shut_down)) == ([first.url, third.url], 1)
    assert receiver._Membership.member == third

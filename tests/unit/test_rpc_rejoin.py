"""A receiver process that left the RPC hub and attaches again, without Ray: the agent's
and the planner's books keep the places of the last ``LEFT_KEPT`` processes that left
(actors/rpc_agent.py, raysync/transports/rpc/planner.py); the receiver process keeps
its torch RPC, under its first rank, for life (raysync/transports/rpc/receiver.py).

A process that returned after more than ``LEFT_KEPT`` others left was admitted as a new
process, at a fresh rank its torch RPC cannot take, and was refused as if it were a
second receiver in a process ("attach every model of this process in one receiver"),
or one the hub "moved" to another rank: the refusal must say what happened and what to
do. torch's RPC calls and store are stood in for (an in-process HashStore)."""

from __future__ import annotations

import asyncio

import pytest
import torch.distributed.rpc as rpc
from torch.distributed import HashStore

from raysync.actors import rpc_agent
from raysync.transports.base import TransportError
from raysync.transports.options import RpcOptions
from raysync.transports.rpc import LEFT_KEPT, RpcMember, receiver
from raysync.transports.rpc import planner as rpc_planner

pytestmark = pytest.mark.skipif(not rpc.is_available(), reason="no torch.distributed.rpc")

FORGOTTEN = r"left the hub's RPC group as rank 1 .*no longer has its place.*Restart this actor"


class _Kv:
    """Stands for Ray's GCS key-value store, which keeps the planner's rank book."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def _internal_kv_get(self, key: str, namespace: str) -> bytes | None:
        return self.values.get(key)

    def _internal_kv_put(self, key: str, value: bytes, overwrite: bool, namespace: str) -> None:
        self.values[key] = value


def _agent(monkeypatch, key: str, **books) -> rpc_agent.RpcAgentActor:
    """An agent of group ``key`` (``books``: its ``known``, ``left`` and ``generation``),
    its member list in a HashStore; no RPC group."""
    monkeypatch.setattr(rpc_agent, "node_ip", lambda: "127.0.0.1")
    monkeypatch.setattr(rpc_agent, "open_master_store", lambda host, t: ("raysync-rpc://x", None))
    monkeypatch.setattr(rpc_agent, "init_rpc", lambda name, rank, url, settings: None)
    agent = rpc_agent.RpcAgentActor(key, "hub", RpcOptions(timeout_s=5.0), **books)
    store = HashStore()
    monkeypatch.setattr(agent, "_group_store", lambda: store)
    monkeypatch.setattr(agent, "_prune", lambda: None)  # nobody to ping
    return agent


def _joins(monkeypatch) -> list[str]:
    """A receiver process that has not joined a group yet: the RPC names it joins as."""
    joined: list[str] = []
    monkeypatch.setattr(receiver, "init_rpc", lambda name, rank, url, settings: joined.append(name))
    monkeypatch.setattr(rpc, "shutdown", lambda graceful: joined.append("shut down"))
    monkeypatch.setattr(receiver._Membership, "member", None)
    monkeypatch.setattr(receiver._Membership, "rank", None)
    monkeypatch.setattr(receiver._Membership, "left", set())
    monkeypatch.setattr(receiver._Membership, "generation", 0)
    monkeypatch.setattr(receiver, "_INBOX", receiver._Inbox())
    monkeypatch.setattr(receiver, "_BUCKETS", receiver._BucketInbox())
    return joined


async def _join(agent: rpc_agent.RpcAgentActor, worker: str, process: str) -> RpcMember:
    """The agent admits ``worker`` of ``process``, which joins its group (torch lists it)."""
    member = await agent.admit(worker, process)
    await asyncio.to_thread(agent._relist, member)
    return member


async def _others_leave(agent: rpc_agent.RpcAgentActor, count: int) -> None:
    """``count`` other processes join the group and leave it."""
    for n in range(count):
        await _join(agent, f"other{n}", f"process{n}")
        await agent.forget(f"other{n}")


def test_a_process_whose_place_the_agent_forgot_is_refused_saying_why(monkeypatch):
    """p0 left, came back to its place, left again; then more than ``LEFT_KEPT`` others
    left, and p0 came back. Its receiver's refusal said a receiver of p0 was still
    open (there was none) and told it to attach its models in one receiver."""
    agent, joined = _agent(monkeypatch, "k1"), _joins(monkeypatch)

    async def attach(worker: str) -> receiver.RpcReceiver:
        return receiver.RpcReceiver(await agent.admit(worker, "p0"))

    async def scenario() -> RpcMember:
        first = await _join(agent, "w0", "p0")
        receiver.RpcReceiver(first).close()
        await agent.forget("w0")
        (await attach("w1")).close()  # its place was kept: back in it
        await agent.forget("w1")
        await _others_leave(agent, LEFT_KEPT)
        with pytest.raises(TransportError, match=FORGOTTEN) as refused:
            await attach("w2")
        assert "receiver 'w2'" in str(refused.value)
        return first

    first = asyncio.run(scenario())
    assert joined == [first.name]  # its torch RPC untouched, under its first name
    assert receiver._Membership.member == first


def test_a_process_whose_place_the_hubs_book_forgot_is_refused_by_the_new_group(monkeypatch):
    """The same, the agent replaced meanwhile: its successor knew p0's rank only from
    the planner's book, which had forgotten it too. The refusal said the hub "moved"
    the process to another rank."""
    monkeypatch.setattr(rpc_planner, "internal_kv", _Kv())
    book, joined = rpc_planner._RankBook("hub"), _joins(monkeypatch)
    first_agent = _agent(monkeypatch, "k1", generation=book.next_generation())

    async def leave_through_the_book(worker: str, process: str) -> RpcMember:
        member = await _join(first_agent, worker, process)
        book.set(worker, process, member.rank)
        book.remove(worker)
        await first_agent.forget(worker)
        return member

    async def scenario() -> RpcMember:
        first = await _join(first_agent, "w0", "p0")
        receiver.RpcReceiver(first).close()
        book.set("w0", "p0", first.rank)
        book.remove("w0")
        await first_agent.forget("w0")
        for n in range(LEFT_KEPT):
            await leave_through_the_book(f"other{n}", f"process{n}")
        second_agent = _agent(
            monkeypatch,
            "k2",
            known=book.load(),
            left=book.left(),
            generation=book.next_generation(),
        )
        with pytest.raises(TransportError, match=FORGOTTEN):
            receiver.RpcReceiver(await second_agent.admit("w1", "p0"))
        return first

    first = asyncio.run(scenario())
    assert joined == [first.name]  # never shut down: still in the group it joined
    assert receiver._Membership.member == first


def test_a_receiver_registering_again_after_the_hub_forgot_its_place_is_refused_saying_why(
    monkeypatch,
):
    """A receiver registers again (a heartbeat's registration) after the hub let it go
    and forgot its place: its new transport receiver opens while its previous one is
    still open, of the same worker; the refusal said the process already had a
    receiver and told it to attach its models in one."""
    agent, joined = _agent(monkeypatch, "k1"), _joins(monkeypatch)

    async def scenario() -> tuple[RpcMember, RpcMember]:
        first = await _join(agent, "w0", "p0")
        await agent.forget("w0")
        await _others_leave(agent, LEFT_KEPT)
        return first, await agent.admit("w0", "p0")

    first, again = asyncio.run(scenario())
    previous = receiver.RpcReceiver(first)
    try:
        with pytest.raises(TransportError, match=FORGOTTEN):
            receiver.RpcReceiver(again)
    finally:
        previous.close()
    assert joined == [first.name]

"""RpcAgentActor: rank 0 of a hub's torch RPC group; sends every version with rpc_async.

Started by :class:`raysync.transports.rpc.RpcPlanner` in the hub process, one per hub,
and killed with it. It owns the rendezvous (a ``TCPStore`` master on a socket bound to
its node's IP, free port, random key prefix), hands out ranks and RPC names (one per receiver
actor, never given to another), and the RPC agent of its process.

Repairing membership: torch's dynamic RPC groups list their members in the store, and
every joiner calls every listed member, so a member that died without leaving would
make every later join fail (and leave the group's join token held). The agent removes
such members from the list itself: when the hub reports a receiver gone (``forget``)
and, before admitting a new one, any listed member that does not answer a ping.

``send`` runs in a worker thread: read the learner's object-store copy, one
``rpc_async`` per target (retried, within the timeout, while a receiver that was just
admitted or is moving to this group is still joining), then wait for every future. Its
result maps each target to ``None`` or why its RPC failed; failures are kept for
``describe``, and each receiver the version will not reach is told why
(``abandon_whole``, not waited for), so its fetch fails at once with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from raysync.bounded import keep_newest
from raysync.layout import PackedLayout
from raysync.transports.base import TransportError
from raysync.transports.bucket_relay import (
    finish,
    read_buckets,
    relay_plan,
    relay_reader,
)
from raysync.transports.object_store.bucket_stream import BucketStream, is_bucketed, streams_of
from raysync.transports.object_store.wire import read_put
from raysync.transports.options import RpcOptions
from raysync.transports.process_groups import node_ip
from raysync.transports.rpc import (
    JOIN_TOKEN_KEY,
    LEFT_KEPT,
    MEMBER_LIST_KEY,
    RpcJob,
    RpcMember,
    abandon_bucketed,
    abandon_whole,
    answer_ping,
    init_rpc,
    land,
    land_bucket,
    open_master_store,
    rpc_name,
)

from .heap import settle_heap

_PING_TIMEOUT_S = 2.0
#: A receiver a send could not reach within its whole timeout (not joined: busy since
#: the agent was replaced, say) is tried this long by the next sends, until one reaches
#: it: each would otherwise hold one of the agent's threads for the whole timeout, and a
#: few broadcasts in flight took them all (admissions and departures waited too).
_UNREACHED_RETRY_S = 1.0


@dataclass(frozen=True)
class _Admitted:
    process: str  #: the admitted receiver process (Ray worker id)
    member: RpcMember


@dataclass(frozen=True)
class AgentStatus:
    url: str
    members: dict[str, str]  #: worker id -> RPC name
    sent: int  #: versions that landed (whole, or every bucket)
    failures: tuple[str, ...]  #: why RPCs failed, oldest first (last 16)
    reader: str  #: how it names itself to the hub's bucket broker


async def _settled(futures: dict[str, torch.futures.Future], timeout_s: float | None) -> None:
    """Return once every one of ``futures`` is done, failed ones included, or after
    ``timeout_s`` (None: no limit; each call has torch's RPC timeout). Waits on the
    event loop: a receiver whose calls hang (a stopped process) holds no thread, and
    the sends to the others go on beside it. (``torch.futures.collect_all`` completes
    at the first failure: one dead receiver's refused call would count every other
    call still on its way as stalled.)"""
    if not futures:
        return
    loop = asyncio.get_running_loop()
    waits = [_on_loop(loop, future) for future in futures.values()]
    await asyncio.wait(waits, timeout=timeout_s)


def _on_loop(
    loop: asyncio.AbstractEventLoop, future: torch.futures.Future
) -> asyncio.Future[None]:
    """A future of ``loop`` done once torch's ``future`` is (its callback runs on an RPC
    thread)."""
    done: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not done.done():
            done.set_result(None)

    def settle_on_loop(_: torch.futures.Future) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle)

    future.add_done_callback(settle_on_loop)
    return done


class RpcAgentActor:
    """See module docstring. Async actor; sends run in threads."""

    def __init__(
        self,
        key: str,
        hub: str,
        settings: RpcOptions,
        known: dict[str, tuple[str, int]] | None = None,
        left: dict[str, int] | None = None,
        generation: int = 0,
    ) -> None:
        """``known``: worker -> (process, rank) of the members of an earlier agent of
        hub ``hub`` (it died, or the hub restarted); each keeps its rank here and moves
        to this group on its next registration or delivery. ``left``: process -> rank
        of the processes that left those groups, each given its rank back if it
        attaches again. ``generation``: this group's number among the hub's."""
        self._key = key
        self._hub = hub
        self._generation = generation
        self._settings = settings
        self._url, self._master = open_master_store(node_ip(), settings.timeout_s)
        init_rpc(rpc_name(key, 0), 0, self._url, settings)
        self._name = rpc_name(key, 0)
        known, left = known or {}, left or {}
        self._members: dict[str, _Admitted] = {
            worker: _Admitted(process, self._member(rank, worker))
            for worker, (process, rank) in known.items()
        }
        taken = [rank for _, rank in known.values()] + list(left.values())
        self._ranks = itertools.count(1 + max(taken, default=0))
        #: process -> its place, for processes that left this group (or died): one that
        #: attaches again gets it back (torch RPC keeps a process's first rank for life)
        self._left: dict[str, RpcMember] = {}
        #: process -> its rank, for processes that left an earlier group: one that
        #: attaches again joins this group under it
        self._left_before = dict(left)
        self._sent = 0
        self._failures: list[str] = []
        #: RPC names the last send to gave up reaching (worker threads share it): by
        #: name, so that a send to a receiver's former process that gives up after its
        #: new process was admitted says nothing of the new one
        self._unreached: set[str] = set()
        self._unreached_lock = threading.Lock()
        #: One edit of the member list at a time in this process: the join token it
        #: takes is the same for each of its edits, so it keeps out only the others'.
        #: (The planner makes one call at a time, but a call it gave up on, cancelled
        #: by the hub's timeout, still runs here beside the next.)
        self._editing = threading.Lock()
        settle_heap()

    async def admit(self, worker: str, process: str) -> RpcMember:
        """``worker``'s rank and RPC name: the same as before for the same process (a
        receiver process is in the group for life), a fresh one for a new process (a
        new receiver, or one Ray restarted: its old name is taken off the list)."""
        known = self._members.get(worker)
        if known is not None and known.process == process:
            return known.member
        if known is not None:
            await asyncio.to_thread(self._unlist, {known.member.name})
            self._reachable_again(known.member.name)
        # Taken off the books once its edit went through: an edit that timed out (a
        # joiner held the token) left the process no record, and a fresh rank its
        # torch RPC, alive under the old one, refuses for good.
        before = self._left.get(process)
        rank_before = self._left_before.get(process)
        if before is not None:
            # It left the hub, but its torch RPC lives on under its rank: its old place.
            member = dataclasses.replace(before, worker=worker)
            await asyncio.to_thread(self._relist, member)
        elif rank_before is not None:  # it joins this group, under its rank for life
            member = self._member(rank_before, worker)
        else:  # a new process, or one whose place went (over LEFT_KEPT left after it)
            await asyncio.to_thread(self._prune)
            member = self._member(next(self._ranks), worker)
        self._left.pop(process, None)
        self._left_before.pop(process, None)
        self._reachable_again(member.name)  # its next join has a send's whole time
        self._members[worker] = _Admitted(process, member)
        return member

    def _reachable_again(self, name: str) -> None:
        """The process under RPC name ``name`` (back in its place, or gone) has a send's
        whole time to become reachable next: its earlier sends say nothing of it."""
        with self._unreached_lock:
            self._unreached.discard(name)

    async def ping(self) -> None:
        """The planner's liveness probe, before every plan."""

    async def members(self) -> dict[str, RpcMember]:
        """worker -> its place in the group."""
        return {worker: admitted.member for worker, admitted in self._members.items()}

    def _member(self, rank: int, worker: str) -> RpcMember:
        return RpcMember(
            self._url,
            self._key,
            self._hub,
            rpc_name(self._key, rank),
            rank,
            self._settings,
            worker,
            self._generation,
        )

    async def forget(self, worker: str) -> None:
        """``worker`` left or died: no more sends, and off the group's member list. Its
        process, if it attaches again, gets its place back (listed again: its torch RPC
        lives on) if it was in the group, else its rank (its join failed, and torch
        took its name off the list: listed, its next ``init_rpc`` would be refused as
        a name not unique)."""
        gone = self._members.pop(worker, None)
        if gone is None:
            return
        member = gone.member
        self._reachable_again(member.name)
        try:
            was_listed = await asyncio.to_thread(self._unlist, {member.name})
        except BaseException:  # changed nothing: still its place (asked again, it goes)
            self._members.setdefault(worker, gone)
            raise
        if f"{member.name}-{member.rank}" in was_listed:
            self._left[gone.process] = member  # its torch RPC lives on: its old place
            keep_newest(self._left, LEFT_KEPT)
        else:  # never in the group (its join failed): it joins anew, under its rank
            self._left_before[gone.process] = member.rank
            keep_newest(self._left_before, LEFT_KEPT)

    async def send(self, job: RpcJob) -> dict[str, str | None]:
        if is_bucketed(job.source):
            return await self._send_buckets(job)
        assert not isinstance(job.source, BucketStream)  # is_bucketed says so
        outcomes: dict[str, str | None]
        try:  # read the learner's copy here: a blocking get would hold the event loop
            arrays = await read_put(job.source, self._settings.timeout_s)
        except Exception as err:
            outcomes = dict.fromkeys(job.workers, f"could not read the update: {err!r}")
        else:
            with warnings.catch_warnings():
                # Read-only views of the object store; RPC only reads them.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                tensors = [torch.from_numpy(a) for a in arrays]
            outcomes = await self._call_each(
                job.workers, land, (self._key, job.seq, tensors, job.model)
            )
            self._sent += sum(why is None for why in outcomes.values())
        # Each receiver the version will not reach hears why now, not at its timeout.
        for worker, why in outcomes.items():
            if why is not None:
                self._tell_quietly(worker, abandon_whole, (self._key, job.seq, why))
        return self._fail(job, outcomes)

    async def _send_buckets(self, job: RpcJob) -> dict[str, str | None]:
        """One ``land_bucket`` call per bucket and receiver, bucket after bucket (see
        :mod:`raysync.transports.bucket_relay`); a receiver whose call fails gets no more."""
        reader = relay_reader(self._key)
        nbytes = PackedLayout.of(job.spec).nbytes
        outcomes: dict[str, str | None] = {}
        live = list(job.workers)
        # The agent is the stream's one reader: waiting for a stalled receiver longer
        # than the broker's stall, the broker dropped the agent, and every receiver of
        # the version failed (blaming the relay) instead of the stalled one alone.
        limit_s = min([self._settings.timeout_s, *(s.key.stall_s for s in streams_of(job.source))])
        try:
            async with contextlib.aclosing(
                read_buckets(relay_plan(job.source, job.spec), reader, self._settings.timeout_s)
            ) as buckets:
                async for bucket, pieces in buckets:
                    args = (self._key, job.seq, nbytes, bucket.pieces, pieces, job.model)
                    dropped = await self._land_bucket(live, args, limit_s / 2)
                    outcomes.update(dropped)
                    live = [worker for worker in live if worker not in dropped]
                    if not live:
                        break
        except TransportError as err:
            why = f"the agent could not read the version: {err}"
            await self._call_each(live, abandon_bucketed, (self._key, job.seq, why))
            outcomes.update(dict.fromkeys(live, why))
            live = []
        finally:
            finish(job.source, reader, live)
        outcomes.update(dict.fromkeys(live))
        self._sent += len(live)
        return self._fail(job, outcomes)

    async def describe(self) -> AgentStatus:
        members = {w: a.member.name for w, a in self._members.items()}
        return AgentStatus(
            self._url, members, self._sent, tuple(self._failures), relay_reader(self._key)
        )

    async def close(self) -> None:
        import torch.distributed.rpc as rpc

        await asyncio.to_thread(rpc.shutdown, graceful=False)

    async def _call_each(
        self, workers: Sequence[str], fn: Callable, args: tuple, stall_s: float | None = None
    ) -> dict[str, str | None]:
        """``rpc_async(worker, fn, args)`` to each of ``workers``, then wait for every
        call: None, or why it failed, per worker. With ``stall_s`` (a bucket), a call not
        made and done within ``stall_s`` fails: a receiver whose process stopped, or that
        never became reachable, would keep the others from the next bucket for the RPC
        timeout, past the time they wait for it. The calls are made on a worker thread
        (see :meth:`_make_calls`) and waited for on the event loop."""
        limit = self._settings.timeout_s if stall_s is None else stall_s
        started = time.monotonic()
        futures, outcomes = await asyncio.to_thread(
            self._make_calls, workers, fn, args, started, limit
        )
        await _settled(futures, None if stall_s is None else started + limit - time.monotonic())
        for worker, future in futures.items():
            if not future.done():
                outcomes[worker] = f"RPC to {worker} not done within {stall_s:g} s"
                continue
            try:
                future.wait()
            except Exception as err:
                outcomes[worker] = f"RPC to {worker} failed: {err}"
            else:
                outcomes[worker] = None
        return outcomes

    # -- worker threads --------------------------------------------------------------------
    def _make_calls(
        self, workers: Sequence[str], fn: Callable, args: tuple, started: float, limit: float
    ) -> tuple[dict[str, torch.futures.Future], dict[str, str | None]]:
        """``rpc_async(worker, fn, args)`` to each of ``workers``, made within ``limit`` of
        ``started`` (``time.monotonic()``): each call's future, and why each call that
        could not be made was not.

        A receiver admitted a moment ago, or moving here from a dead agent's group, may
        still be inside ``init_rpc``: until its join reaches this process ``rpc_async``
        raises ``RuntimeError``, and it still does for a moment after
        ``get_worker_info(name)`` answers (torch knows the name before the address:
        "could not find destination url"). So a call torch cannot make yet is tried
        again until the deadline, while the calls to the others are on their way: one
        receiver that never joins costs the others nothing (tried one after the other,
        it held every later receiver's call back to the deadline)."""
        import torch.distributed.rpc as rpc

        deadline = started + limit
        outcomes: dict[str, str | None] = {}
        pending: dict[str, str] = {}  #: worker -> its RPC name, not called yet
        for worker in workers:
            admitted = self._members.get(worker)
            if admitted is None:
                outcomes[worker] = "not a member of the RPC group (it left or died)"
            else:
                pending[worker] = admitted.member.name
        with self._unreached_lock:
            unreached = {w for w, name in pending.items() if name in self._unreached}
        futures: dict[str, torch.futures.Future] = {}
        while pending:
            for worker, name in list(pending.items()):
                try:
                    futures[worker] = rpc.rpc_async(
                        name, fn, args=args, timeout=max(0.1, deadline - time.monotonic())
                    )
                except RuntimeError as err:
                    tried_s = _UNREACHED_RETRY_S if worker in unreached else limit
                    if time.monotonic() <= min(deadline, started + tried_s):
                        continue  # not reachable yet: again, after the others
                    before = " (nor could the send before)" if worker in unreached else ""
                    outcomes[worker] = (
                        f"could not send to {name} within {tried_s:g} s{before}: {err}"
                    )
                    with self._unreached_lock:
                        self._unreached.add(name)
                except Exception as err:
                    outcomes[worker] = f"could not send to {name}: {err}"
                else:
                    if worker in unreached:
                        with self._unreached_lock:
                            self._unreached.discard(name)
                del pending[worker]
            if pending:
                time.sleep(0.01)
        return futures, outcomes

    async def _land_bucket(
        self, workers: Sequence[str], args: tuple, limit_s: float
    ) -> dict[str, str]:
        """One bucket (``land_bucket``'s ``args``) to each of ``workers``, each call
        waited for ``limit_s`` at most: why each that failed did. Those get no more
        buckets of the version, and are told so with ``abandon_bucketed``, not waited
        for: one whose call only stalled (a busy process) would otherwise wait the whole
        timeout for its next bucket and fail with a guess ("the RPC agent may have
        died") instead of this reason."""
        called = await self._call_each(workers, land_bucket, args, limit_s)
        dropped = {worker: why for worker, why in called.items() if why is not None}
        key, seq = args[0], args[1]
        for worker, why in dropped.items():
            self._tell_quietly(
                worker, abandon_bucketed, (key, seq, f"the RPC agent gave it up: {why}")
            )
        return dropped

    def _tell_quietly(self, worker: str, fn: Callable, args: tuple) -> None:
        """``rpc_async(worker, fn, args)`` not waited for; a receiver that is gone or cannot
        be reached is not told, and that is all."""
        import torch.distributed.rpc as rpc

        admitted = self._members.get(worker)
        if admitted is None:
            return
        try:
            rpc.rpc_async(admitted.member.name, fn, args=args, timeout=self._settings.timeout_s)
        except Exception:
            return  # torch's own error: the receiver is not in reach

    def _fail(self, job: RpcJob, outcomes: dict[str, str | None]) -> dict[str, str | None]:
        for worker, reason in outcomes.items():
            if reason is not None:
                self._failures = [
                    *self._failures[-15:],
                    f"version {job.version} of model {job.model!r} to {worker}: {reason}",
                ]
        return outcomes

    # -- membership repair (worker threads) -------------------------------------------------
    def _group_store(self) -> Any:
        import torch.distributed.rpc as rpc

        # torch private: the TensorPipe agent's store (not in torch's RpcAgent stub).
        return rpc.api._get_current_rpc_agent().store  # type: ignore[attr-defined]

    def _listed(self) -> list[str]:
        """The group's member list as the store has it: "name-rank" entries."""
        store = self._group_store()
        if not store.check([MEMBER_LIST_KEY]):
            return []
        return [e for e in store.get(MEMBER_LIST_KEY).decode().split(",") if e]

    def _prune(self) -> None:
        """Unlist members that do not answer (died without leaving the group)."""
        import torch.distributed.rpc as rpc

        dead = set()
        pings = {}
        for entry in self._listed():  # all at once: a join costs one ping's time
            name = entry.rsplit("-", 1)[0]
            if name == self._name:
                continue
            try:
                pings[name] = rpc.rpc_async(name, answer_ping, timeout=_PING_TIMEOUT_S)
            except Exception:
                dead.add(name)
        for name, ping in pings.items():
            try:
                ping.wait()
            except Exception:
                dead.add(name)
        if dead:
            self._unlist(dead)

    def _unlist(self, names: set[str]) -> set[str]:
        """Remove ``names`` from the member list (:meth:`_edit_list`); the entries of
        theirs that were on it."""
        removed: set[str] = set()

        def edit(listed: list[str]) -> list[str]:
            removed.update(e for e in listed if e.rsplit("-", 1)[0] in names)
            return [e for e in listed if e not in removed]

        self._edit_list(names, edit)
        return removed

    def _relist(self, member: RpcMember) -> None:
        """Put ``member`` (a live process that left, attaching again) back on the list."""
        entry = f"{member.name}-{member.rank}"
        self._edit_list(set(), lambda listed: [e for e in listed if e != entry] + [entry])

    def _edit_list(self, names: set[str], edit: Callable[[list[str]], list[str]]) -> None:
        """Rewrite the member list with ``edit``, holding the group's join token (taken
        over if one of ``names`` died holding it)."""
        with self._editing:
            self._edit_list_alone(names, edit)

    def _edit_list_alone(self, names: set[str], edit: Callable[[list[str]], list[str]]) -> None:
        """(``_editing`` held.) See :meth:`_edit_list`."""
        store = self._group_store()
        mine = f"Token_for_{self._name}_leave"
        orphaned = {f"Token_for_{n}_{op}" for n in names for op in ("join", "leave")}
        deadline = time.monotonic() + self._settings.timeout_s
        while True:
            holder = store.compare_set(JOIN_TOKEN_KEY, "", mine).decode()
            if holder == mine:
                break
            if holder in orphaned:
                store.compare_set(JOIN_TOKEN_KEY, holder, mine)
                store.set(holder, "Done")  # wakes joiners waiting on the dead holder
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"the RPC group's join token stayed with {holder}")
            time.sleep(0.01)
        try:
            store.set(MEMBER_LIST_KEY, "".join(f"{e}," for e in edit(self._listed())))
        finally:
            store.set(JOIN_TOKEN_KEY, "")
            store.set(mine, "Done")

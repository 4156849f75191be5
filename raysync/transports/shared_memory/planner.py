"""Hub process: the shared-memory planner, one owner per node, holds and relays."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayError

from raysync.actor_classes import SHM_OWNER, actor_class
from raysync.background import BackgroundTasks
from raysync.named_actors import start_again
from raysync.spec import WeightSpec
from raysync.transports.base import (
    HubContext,
    ReceiverInfo,
    TransportError,
    TransportPlanner,
    Unplanned,
    plan_share_left,
)
from raysync.transports.object_store.bucket_stream import BucketStream
from raysync.transports.object_store.planner import ObjectStorePlanner
from raysync.transports.parts import payloads_in
from raysync.transports.shared_memory.wire import (
    MAX_SLOTS,
    OWNER_NAMESPACE,
    OWNER_THREADS,
    OWNER_WAIT_S,
    SLOT_WAIT_S,
    SharedMemoryPayload,
    SharedMemoryReceiverInfo,
    owner_name,
)

logger = logging.getLogger(__name__)


class SharedMemoryPlanner(TransportPlanner):
    """Hub side: one owner per node; holds on the learner's node, relays to the others."""

    def __init__(self, hub: HubContext) -> None:
        self._hub_id = hub.hub_id
        self._owners: dict[str, Any] = {}
        #: worker -> the node it joined from last (a restarted one may join elsewhere)
        self._node_of: dict[str, str] = {}
        #: Per node, the number of the last of the hub's calls sent to its owner that
        #: run in the order sent (joins, holds, exports: see ShmOwner.deliver).
        self._orders: dict[str, int] = {}
        #: The number of the next call that holds a slot for workers (a hold or a relay,
        #: on any node): a plan cut short withdraws the holds of its own calls by it,
        #: and leaves those another delivery of the version took (ShmOwner.withdraw).
        self._placements = itertools.count(1)
        self._closed = False
        self._background = BackgroundTasks("shared-memory planner")
        #: per model: (version, node -> payload) of the latest version planned.
        self._latest: dict[str, tuple[int, dict[str, SharedMemoryPayload]]] = {}
        #: Bucketed versions: the object store's bucket stream, planned as it plans them.
        self._streams = ObjectStorePlanner()
        for node in ray.nodes():
            if node["Alive"]:
                self._start_owner(node["NodeID"])

    def _start_owner(self, node_id: str) -> Any:
        owner = (
            ray.remote(actor_class(SHM_OWNER))
            .options(
                name=owner_name(self._hub_id, node_id),
                namespace=OWNER_NAMESPACE,
                num_cpus=0,
                max_concurrency=OWNER_THREADS,
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id, soft=False
                ),
            )
            .remote(node_id, MAX_SLOTS)
        )
        self._owners[node_id] = owner
        self._orders[node_id] = 0
        self._background.spawn(self._watch(node_id, owner), f"watch the owner on {node_id}")
        return owner

    def _next_order(self, node_id: str) -> int:
        """The number of the next call to ``node_id``'s owner in the hub's order."""
        self._orders[node_id] += 1
        return self._orders[node_id]

    async def _watch(self, node_id: str, owner: Any) -> None:
        """Restart ``node_id``'s owner if it dies while the hub is open and the node lives
        (an owner whose node died cannot be scheduled: Ray says so with a RayError), as
        soon as Ray lets this process have its name again
        (:func:`raysync.named_actors.start_again`), within the learner's wait for it."""
        try:
            await owner.closed.remote()
            return
        except RayError:
            if self._closed or self._owners.get(node_id) is not owner:
                return
            del self._owners[node_id]
            for _, payloads in self._latest.values():
                payloads.pop(node_id, None)
        del owner  # no handle of the dead owner kept here: Ray keeps its name for it

        def start() -> Any:
            if self._closed or node_id in self._owners or not _alive(node_id):
                return None  # closed, started meanwhile (a join), or its node is gone
            return self._start_owner(node_id)

        await start_again(start, OWNER_WAIT_S)

    def _owner(self, node_id: str) -> Any:
        """``node_id``'s owner, started if it has none; TransportError if the node is gone."""
        owner = self._owners.get(node_id)
        if owner is not None:
            return owner
        if not _alive(node_id):
            raise TransportError(
                f"node {node_id} is gone: no shared-memory owner can run there (its "
                "receivers died with it)"
            )
        return self._start_owner(node_id)

    def receiver_joined(
        self, receiver: ReceiverInfo
    ) -> Coroutine[Any, Any, SharedMemoryReceiverInfo]:
        """The owner on ``receiver``'s node is told it joined *when this is called*, not
        when the result is awaited: the hub calls it in the same step as it books the
        registration, so the join is numbered in the owner's order before the hold of
        any plan that targets the worker. The owner runs it first, however Ray's threads
        start the two (a hold it ran first was forgotten by the join: the worker then
        staged that version, or a zero-copy model adopted it, with nothing holding the
        slot but ``latest``, and the learner could rewrite it once a newer version
        came)."""
        # A (re)joining worker holds nothing yet: drop what a former incarnation held,
        # but the slots it still reads (its zero-copy models' memory, versions staged).
        kept = tuple(
            (p.slot.pid, p.slot.seq)
            for p in receiver.kept
            if isinstance(p, SharedMemoryPayload) and p.slot.node_id == receiver.node_id
        )
        owner = self._owner(receiver.node_id)
        joined = owner.join.remote(
            receiver.worker, kept, receiver.pid, self._next_order(receiver.node_id)
        )
        return self._joined(receiver, joined)

    async def _joined(
        self, receiver: ReceiverInfo, joined: ray.ObjectRef
    ) -> SharedMemoryReceiverInfo:
        """The rest of :meth:`receiver_joined`, once the owner's join is sent."""
        board = await joined
        former = self._node_of.get(receiver.worker)
        self._node_of[receiver.worker] = receiver.node_id
        if former not in (None, receiver.node_id) and former in self._owners:
            # A former incarnation on another node: its holds there go too.
            dropped = self._drop_worker(former, receiver.worker)
            self._background.spawn(_answered(dropped), f"{receiver.worker}'s holds on {former}")
        await self._streams.receiver_joined(receiver)
        return SharedMemoryReceiverInfo(
            receiver.worker, owner_name(self._hub_id, receiver.node_id), board
        )

    async def receiver_left(self, worker: str) -> None:
        """Every owner lets go of ``worker``'s holds. Sent to all at once, each numbered
        in the hub's order: a drop sent only once the owner before answered (one on a
        node being lost answers late) reached a node after the worker's new
        registration joined there, forgot the holds of that one's versions (its
        zero-copy model's slot too) and turned every later hold for it away."""
        self._node_of.pop(worker, None)
        dropped = [self._drop_worker(node_id, worker) for node_id in list(self._owners)]
        await self._streams.receiver_left(worker)
        for answer in dropped:
            await _answered(answer)

    async def receiver_lapsed(self, worker: str) -> None:
        """Its holds stay (its zero-copy model may live in a slot; see
        ``ShmOwner.lapse``), trimmed when it joins again; its bucket streams go. Sent
        at once, numbered, as :meth:`receiver_left`'s drops."""
        lapsed = [
            owner.lapse.remote(worker, self._next_order(node_id))
            for node_id, owner in list(self._owners.items())
        ]
        await self._streams.receiver_left(worker)
        for answer in lapsed:
            await _answered(answer)

    def _drop_worker(self, node_id: str, worker: str) -> ray.ObjectRef:
        """``node_id``'s owner lets go of every hold of ``worker`` (it left, or joined on
        another node), in the hub's order of calls there."""
        return self._owners[node_id].drop_worker.remote(worker, (), self._next_order(node_id))

    async def published(self, update: Any, spec: WeightSpec) -> None:
        """A version no receiver is sent (they pull): the learner's node's owner holds it
        as the latest and frees the learner's older unplanned slots, as a plan would
        (else every slot stayed pending and the learner waited for one)."""
        if isinstance(update.payload, BucketStream):
            return
        slot = update.payload.slot
        owner = self._owners.get(slot.node_id)
        if owner is None:
            return  # lost with its owner; the restarted one holds none of its slots
        self._hold(owner, update, ())

    def abandoned(self, payload: Any, read_by: Sequence[str] = ()) -> None:
        """A version the hub refused: its slot is never planned, so the learner's node's
        owner lets it go now (else it stayed pending until a newer version of its model
        from that learner was planned, and a few refusals in a row held every slot),
        but for the receivers its learner delivered it to itself (``read_by``), for
        whom it holds it until each lets go. Numbered when called: the owner runs it
        before the hold of any version the hub plans after."""
        if isinstance(payload, BucketStream):
            self._streams.abandoned(payload, read_by)
            return
        if not isinstance(payload, SharedMemoryPayload):
            return
        slot = payload.slot
        owner = self._owners.get(slot.node_id)
        if owner is not None:  # else lost with its owner
            let_go = owner.abandon.remote(
                slot.pid, slot.seq, tuple(read_by), self._next_order(slot.node_id)
            )
            self._background.spawn(_answered(let_go), f"slot {slot.seq} of a refused version")

    def set_aside(self, payload: Any, worker: str) -> bool:
        """A delivery of ``payload`` may never make its own call (it waits for its busy
        receiver's running call while a newer version waits too, or it ended without
        a call): the holds its plan took for ``worker`` go
        (withdrawn, numbered after them: one that another delivery of the version took
        stays). Each version broadcast while a receiver was busy held its slot for it,
        until the learner's slots ran out and every broadcast, to every receiver, failed.
        The delivery plans its read again if it goes (:meth:`plan_pull`)."""
        set_aside = False
        for part in payloads_in((payload,)):
            if not isinstance(part, SharedMemoryPayload) or not part.placement:
                continue  # a bucket stream holds no slot; a learner's own payload no hold
            slot = part.slot
            owner = self._owners.get(slot.node_id)
            if owner is None:
                continue  # lost with its owner: the restarted one holds none of its slots
            withdrawn = owner.withdraw.remote(
                slot.pid, slot.seq, (worker,), part.placement, self._next_order(slot.node_id)
            )
            self._background.spawn(_answered(withdrawn), f"slot {slot.seq} set aside for {worker}")
            set_aside = True
        return set_aside

    async def plan_pull(self, update: Any, spec: WeightSpec, receiver: ReceiverInfo) -> Any:
        """A puller reads its own node's copy, held for it like a broadcast's target (a
        bucketed version: from a receiver that holds it, through the bucket broker)."""
        if isinstance(update.payload, BucketStream):
            return await self._streams.plan_pull(update, spec, receiver)
        if isinstance(update.payload, Unplanned):  # a part a delivery planned again
            raise TransportError(update.payload.reason)
        payload = (await self._plan(update, spec, [receiver], confirmed=True))[receiver.worker]
        if isinstance(payload, Unplanned):
            raise TransportError(payload.reason)
        return payload

    async def plan(
        self, update: Any, spec: WeightSpec, targets: Sequence[ReceiverInfo]
    ) -> Mapping[str, Any]:
        return await self._plan(update, spec, targets)

    async def _plan(
        self,
        update: Any,
        spec: WeightSpec,
        targets: Sequence[ReceiverInfo],
        confirmed: bool = False,
    ) -> Mapping[str, Any]:
        """:meth:`plan`; ``confirmed``: the receivers on the learner's node get their
        payload only once the owner took their hold. A broadcast's plan need not wait:
        the learner's ``PENDING`` hold keeps its new slot until the owner takes the
        plan's. A pull (a late joiner's catch-up) reads a version published earlier,
        whose slot only its ``latest`` hold kept: a newer version's plan, numbered
        first, moves that hold off, the learner may be handed the slot for its next
        version, and the pull's hold, refused then, left the receiver reading (a
        zero-copy model adopting) memory the learner would write again."""
        if isinstance(update.payload, BucketStream):
            return await self._streams.plan(update, spec, targets)
        source: SharedMemoryPayload = update.payload
        slot = source.slot
        by_node: dict[str, list[str]] = {}
        for receiver in targets:
            by_node.setdefault(receiver.node_id, []).append(receiver.worker)
        owner = self._owners.get(slot.node_id)
        if owner is None:
            raise TransportError(
                f"version {update.version} of model {update.model!r} was lost with the "
                f"shared-memory owner on the learner's node {slot.node_id}, which died; "
                "the next broadcast is readable again"
            )
        # Not awaited, so receivers start reading at once: the learner's PENDING hold
        # keeps the slot until the owner gets this, and a receiver's release that
        # arrives first is remembered. Numbered, so the owner takes the holds in the
        # hub's planning order (which frees slots of versions the hub refused).
        local = tuple(by_node.pop(slot.node_id, ()))
        # The learner called these itself: they read the slot whatever becomes of this
        # plan, and each lets go of its own hold once it copied the version (or turned
        # the call down unread).
        called = {r.worker for r in targets if r.called_by_learner}
        held, placement = self._hold(owner, update, local, tuple(w for w in local if w in called))
        uncalled = tuple(w for w in local if w not in called)
        placed: list[_Placed] = [_Placed(owner, held, uncalled, placement)]
        try:
            if confirmed and local:
                try:
                    await _within_plan(held, f"the owner on the learner's node {slot.node_id}")
                except (RayError, TransportError) as err:
                    raise TransportError(
                        f"version {update.version} of model {update.model!r} could not be "
                        f"held for {', '.join(local)}: {err}"
                    ) from err
            held_here = dataclasses.replace(source, placement=placement)
            return await self._relay(update, held_here, owner, local, by_node, placed)
        except BaseException:
            # Cut short (by its timeout, or an error): the holds it placed for workers
            # the hub was to deliver to will never be read; left, they would fill the
            # pools.
            for call in placed:
                if call.workers:
                    self._background.spawn(self._let_go(call), "holds of a plan cut short")
            raise

    async def _relay(
        self,
        update: Any,
        source: SharedMemoryPayload,
        owner: Any,
        local: tuple[str, ...],
        by_node: dict[str, list[str]],
        placed: list[_Placed],
    ) -> dict[str, SharedMemoryPayload | Unplanned]:
        """The payloads of a version held on the learner's node: its receivers
        (``local``) read the learner's slot (``source``, naming the placement of their
        hold), those of ``by_node`` (the other nodes) their
        node's relay of it, exported once by ``owner`` (the learner's node's). Each call
        that holds a slot is added to ``placed`` as it is made (and taken out when given
        up: its holds are let go then). A node whose owner does not answer within half
        of what is left of the plan's time fails alone, as does every node the export
        was for if it did not come in that time."""
        slot = source.slot
        payloads: dict[str, SharedMemoryPayload | Unplanned] = dict.fromkeys(local, source)
        if not by_node:
            return payloads
        version, relayed = self._latest.get(update.model, (0, {}))
        if version != update.version:
            relayed = {}
            if update.version > version:
                self._latest[update.model] = (update.version, relayed)
        missing = [node_id for node_id in by_node if node_id not in relayed]
        export = None
        if missing:  # numbered next to its hold: the owner exports it before a newer one
            turn = self._next_order(slot.node_id)
            try:
                export = await _within_plan(
                    owner.export.remote(slot.pid, slot.seq, turn),
                    f"the export of the version for other nodes by the owner on {slot.node_id}",
                )
            except (RayError, TransportError) as err:  # the nodes it was for fail, no other
                why = Unplanned(f"the shared-memory export for other nodes failed: {err}")
                for node_id in missing:
                    payloads.update(dict.fromkeys(by_node.pop(node_id), why))

        async def to_node(node_id: str, workers: tuple[str, ...]) -> None:
            node_owner = self._owner(node_id)
            known = relayed.get(node_id)
            placement = next(self._placements)
            if known is not None:
                answer = node_owner.deliver.remote(
                    known.slot.pid,
                    known.slot.seq,
                    update.model,
                    workers,
                    self._next_order(node_id),
                    update.version,
                    placement,
                )
            else:
                answer = node_owner.relay.remote(
                    export,
                    slot.nbytes,
                    update.model,
                    workers,
                    _slot_wait_s(),
                    update.version,
                    placement,
                    self._orders[node_id],  # its holds come after the calls sent before
                )
            placed.append(call := _Placed(node_owner, answer, workers, placement))
            try:
                held = await _within_plan(answer, f"the shared-memory owner on node {node_id}")
            except TransportError:  # given up: the holds it may take yet are let go
                placed.remove(call)
                self._background.spawn(self._let_go(call), "holds of a relay given up")
                raise
            relayed[node_id] = SharedMemoryPayload(held)
            payloads.update(dict.fromkeys(workers, SharedMemoryPayload(held, placement)))

        relays = await asyncio.gather(
            *(to_node(n, tuple(ws)) for n, ws in by_node.items()), return_exceptions=True
        )
        for (node_id, workers), relay in zip(by_node.items(), relays, strict=True):
            if isinstance(relay, BaseException):  # that node's receivers fail, no other
                if not isinstance(relay, Exception):
                    raise relay
                why = Unplanned(f"the shared-memory relay to node {node_id} failed: {relay!r}")
                payloads.update(dict.fromkeys(workers, why))
        return payloads

    async def _let_go(self, call: _Placed) -> None:
        """Withdraw the holds one call of a plan cut short took for its workers, once
        the owner answers it (with the slot). Withdrawn, not released on the workers'
        behalf: the owner holds a slot once per worker, and a worker this version
        reached through another delivery (a pull, its welcome's catch-up) keeps the
        hold that one took."""
        try:
            slot = await call.answer
        except (RayError, TransportError):
            return  # it took none
        try:
            await call.holder.withdraw.remote(slot.pid, slot.seq, call.workers, call.placement)
        except RayError:
            pass  # its watch restarts it (a new owner holds nothing), or its node died

    def _hold(
        self, owner: Any, update: Any, workers: tuple[str, ...], called: tuple[str, ...] = ()
    ) -> tuple[ray.ObjectRef, int]:
        """Have ``owner`` (the learner's node's) hold ``update``'s slot for ``workers`` and
        as the latest of its model, numbered in the hub's planning order; not awaited
        (a refusal is logged). ``called``: those the learner delivered it to itself.
        The owner's answer (the slot), and the call's placement number (see
        :meth:`_let_go`)."""
        slot = update.payload.slot
        placement = next(self._placements)
        held = owner.deliver.remote(
            slot.pid,
            slot.seq,
            update.model,
            workers,
            self._next_order(slot.node_id),
            update.version,
            placement,
            called,
        )
        self._background.spawn(self._confirm(held, update), f"hold of {update.model!r}")
        return held, placement

    async def _confirm(self, held: ray.ObjectRef, update: Any) -> None:
        """Log a hold the owner refused; its receivers fail on the slot's sequence check."""
        try:
            await held
        except (RayError, TransportError) as err:
            logger.warning(
                "shared-memory owner could not hold version %d of model %r: %s",
                update.version,
                update.model,
                err,
            )

    async def close(self) -> None:
        self._closed = True
        await self._streams.close()
        await self._background.close()
        for owner in self._owners.values():
            try:
                await owner.close.remote()
            except RayError:
                pass  # died already (or its node did): its segments died with its process
            ray.kill(owner)
        self._owners.clear()


@dataclass(frozen=True)
class _Placed:
    """One call of a plan that holds a slot for workers the hub would deliver to."""

    holder: Any  #: the owner called
    answer: ray.ObjectRef  #: its answer: the slot, once held
    workers: tuple[str, ...]
    placement: int  #: the call's number (see ``ShmOwner.withdraw``)


async def _answered(answer: ray.ObjectRef) -> None:
    """An owner's answer to a call that lets go (of a worker's holds, of a refused
    version's slot), once it comes."""
    try:
        await answer
    except RayError:
        pass  # its watch restarts it (a new owner holds nothing), or its node died


def _slot_wait_s() -> float:
    """How long a relay waits for a free slot on its node: ``SLOT_WAIT_S``, or half of
    what is left of the hub's plan deadline (a node whose slots stay held, by a
    receiver stuck there, then fails alone: the other nodes' receivers get their
    payloads and the rest of the time to read them)."""
    half = plan_share_left(0.5)  # a node that hangs fails alone, the others read
    return SLOT_WAIT_S if half is None else min(SLOT_WAIT_S, half)


async def _within_plan(answer: ray.ObjectRef, who: str) -> Any:
    """``answer`` once it comes, or TransportError once half of what is left of the
    hub's plan deadline has passed (a node whose owner hangs then fails alone: the
    others get their payloads and the rest of the time to read them)."""
    wait_s = plan_share_left(0.5)
    if wait_s is None:
        return await answer
    try:
        return await asyncio.wait_for(answer, wait_s)
    except asyncio.TimeoutError:
        raise TransportError(
            f"{who} had not answered within {wait_s:.3g} s (half of the time left to plan "
            "the version); the other nodes' receivers went on"
        ) from None


def _alive(node_id: str) -> bool:
    """Whether Ray lists node ``node_id`` as alive (asks the GCS)."""
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())

"""Hub process: the distributed planner, forming generations and handing rank 0 its jobs."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysync.actor_classes import PROCESS_GROUP, actor_class
from raysync.spec import WeightSpec
from raysync.transports.base import (
    HubContext,
    ReceiverInfo,
    TransportError,
    TransportPlanner,
    Unplanned,
    plan_share_left,
)
from raysync.transports.bucket_relay import bucket_count
from raysync.transports.distributed.wire import (
    BroadcastJob,
    Generation,
    GroupPayload,
    MemberInfo,
    StoreAddress,
    collective_bytes,
    process_group_name,
    rank0_reader,
)
from raysync.transports.object_store.bucket_stream import is_bucketed, streams_of
from raysync.transports.object_store.planner import BucketServing, tell_broker
from raysync.transports.options import MIN_TIMEOUT_S, DistributedOptions
from raysync.transports.parts import plan_pull_parts

logger = logging.getLogger(__name__)

#: How often the hub asks a restarting process-group actor whether it is back.
_RESTART_POLL_S = 0.1
#: The share of what is left of a plan's time (``PLAN_DEADLINE``) it waits for rank 0
#: to finish the last collective (a version whose learner's copy its targets can read
#: instead): past it, they read that copy alone, and the plan still ends in time. It
#: waited until the hub gave the plan up, and every target failed, none reading.
LAST_COLLECTIVE_SHARE = 0.5
#: The share of what is left of a plan's time the members of a generation it forms
#: have to form the group once all arrived at its rendezvous (``Generation.form_s``):
#: a member that died then held every other rank (rank 0 too) for the group's timeout,
#: and the fallback reads came after the broadcast's timeout.
FORMATION_SHARE = 0.5


class DistributedPlanner(TransportPlanner):
    """Runs in the hub process; owns generation and rank assignment (see module doc)."""

    def __init__(self, hub: HubContext, rank0: Any = None) -> None:
        """``rank0``: the process-group actor to plan for (default: one started here, on
        the hub's node; a unit test passes a stand-in)."""
        self._settings = hub.options or DistributedOptions()
        self._name = process_group_name(hub.hub_id)
        self._actor = rank0 if rank0 is not None else _start_rank0(self._name, self._settings)
        self._store: StoreAddress | None = None
        self._generation: Generation | None = None
        self._generations = 0  #: generations formed so far; numbers only grow
        self._next_seq = 0
        #: the last collective planned: whether it failed (a task that awaits rank 0's
        #: answer), the generation it was planned in, and what it is, for the log
        self._last_job: tuple[asyncio.Future[bool], int, str] | None = None
        #: worker -> until when (``time.monotonic()``) it reads the learner's copy alone:
        #: it never came to the rendezvous of a collective that failed for it (busy, its
        #: delivery queued; the hub marks it behind only once that delivery timed out)
        self._sitting_out: dict[str, float] = {}
        self._lock = asyncio.Lock()  #: plans run one at a time, in call order
        self._reader = rank0_reader(hub.hub_id)  #: rank 0, to the bucket broker
        self._receivers: dict[str, ReceiverInfo] = {}
        self._serving = BucketServing(self._receivers)  #: bucketed versions, pulled
        self._broker: Any = None  #: the hub's bucket broker, once a bucketed version came

    async def receiver_joined(self, receiver: ReceiverInfo) -> MemberInfo:
        """The receiver's worker id (how it names itself to the bucket broker) and the
        last generation formed so far, which it takes no part in. Known before the first
        wait: a plan that runs meanwhile gives a former registration of the worker (a
        process Ray restarted, a receiver attached again) no place in a generation,
        which nobody would call off."""
        self._receivers[receiver.worker] = receiver
        self._sitting_out.pop(receiver.worker, None)
        formed_before = self._generations
        await self._forget(receiver.worker, "registered again (a new process)")
        self._broker = await tell_broker(self._broker, "readmit", receiver.worker)
        return MemberInfo(receiver.worker, formed_before)

    async def receiver_left(self, worker: str) -> None:
        self._receivers.pop(worker, None)  # no plan from now on takes it in
        self._sitting_out.pop(worker, None)
        await self._forget(worker, "died or left")
        # It may read a version itself from the broker, its group broken.
        self._broker = await tell_broker(self._broker, "drop_reader", worker)

    async def _forget(self, worker: str, why: str) -> None:
        """``worker`` will not join the current generation: the next plan forms a new
        one, and rank 0 calls this one off, so that members still waiting at its
        rendezvous (the version planned before the hub heard) stop waiting for it."""
        generation = self._generation
        if generation is None or worker not in generation.members:
            return
        self._generation = None
        try:
            await self._actor.call_off.remote(generation, f"member {worker} {why}")
        except ray.exceptions.RayActorError as err:  # restarting: a new rendezvous anyway
            logger.info("could not call generation %d off: %s", generation.number, err)

    async def plan(
        self, update: Any, spec: WeightSpec, targets: Sequence[ReceiverInfo]
    ) -> Mapping[str, Any]:
        if not targets:
            return {}
        async with self._lock:
            # Cancelled anywhere before the job is sent (the broadcast's timeout), a
            # plan leaves this state as it found it: the last job, still to be heard
            # from, and no sequence number taken.
            last = self._last_job
            if last is not None:
                failed = await self._outcome(last, is_bucketed(update.payload))
                if failed is None:  # rank 0 still runs it: no collective this time
                    return self._alone_all(update, targets)
                self._last_job = None
                if failed:
                    self._generation = None  # form a new one
                    await self._sit_out_absent(last[1])
            alone, members = self._members(update, targets)
            if not members:
                return alone
            store = await self._rank0_store()
            # Asked again after the wait: one that left meanwhile (while Ray restarted
            # rank 0, say) would be a member of a generation no one calls off.
            alone, members = self._members(update, targets)
            if not members:
                return alone
            if store != self._store:  # first plan, or Ray restarted rank 0: new rendezvous
                self._store, self._generation = store, None
            generation = self._generation
            if generation is None or generation.members != members:
                self._generations += 1
                generation = Generation(
                    self._generations,
                    members,
                    f"raysync/{uuid.uuid4().hex}/",
                    self._store,
                    self._settings,
                    form_s=plan_share_left(FORMATION_SHARE, at_least=MIN_TIMEOUT_S),
                )
                self._generation = generation
                self._next_seq = 0
            for stream in streams_of(update.payload):  # rank 0 reads and relays it
                self._broker = stream.broker
                await stream.broker.readers.remote(stream.key, [self._reader])
            seq = self._next_seq
            self._next_seq += 1
            buckets = bucket_count(update.payload) if is_bucketed(update.payload) else 0
            nbytes = collective_bytes(update.payload, spec)
            job = BroadcastJob(generation, seq, update.model, update.version, spec, update.payload)
            outcome = asyncio.ensure_future(
                self._collective_failed(self._actor.broadcast.remote(job, self._reader))
            )
            what = (
                f"collective {seq} of process-group generation {generation.number} (version "
                f"{update.version} of model {update.model!r} to {', '.join(members)})"
            )
            self._last_job = (outcome, generation.number, what)
            return alone | {
                worker: GroupPayload(
                    generation, generation.rank_of(worker), seq, update.payload, nbytes, buckets
                )
                for worker in members
            }

    def _members(
        self, update: Any, targets: Sequence[ReceiverInfo]
    ) -> tuple[dict[str, Any], tuple[str, ...]]:
        """``targets`` that read the learner's copy alone, and the (sorted) members of
        the collective: those still registered now. A target that left while this plan
        waited (its targets were chosen before the hub heard) has no place in a
        generation: the hub fails it alone (it gets no payload), and the others do not
        wait for it at the rendezvous. One behind (busy in a long method, its last
        delivery timed out) reads the learner's copy alone until it acks again: in the
        collective it held every other member up for the group's timeout at each
        version. A bucketed version has no copy to read: it stays a member (and fails
        alone). A target that is not its worker's registration any more (chosen
        before the worker registered again: a process Ray restarted, a receiver
        attached anew) is left out as one that left: no process joins in its place.
        A process takes part once: its other receivers (attached under other
        worker ids) read the learner's copy too, or fail alone if there is none; as two
        ranks of one actor, called one at a time, they waited for each other at every
        version, and the whole group for its timeout."""
        here = [t for t in targets if self._registered(t)]
        bucketed = is_bucketed(update.payload)
        now = time.monotonic()
        for worker in [w for w, until in self._sitting_out.items() if until <= now]:
            del self._sitting_out[worker]
        alone: dict[str, Any] = (
            {} if bucketed else _alone(here, update.payload, set(self._sitting_out))
        )
        in_group: set[str] = set()
        for target in sorted(here, key=lambda t: t.worker):
            if target.worker in alone:
                continue
            if target.process not in in_group:
                in_group.add(target.process)
            elif bucketed:
                alone[target.worker] = Unplanned(
                    f"{target.actor} holds another receiver of this hub's distributed "
                    "group, and a process takes part in it once; a bucketed version has "
                    "no copy of the learner's to read: attach every model of the "
                    "process in one receiver, or give this one another transport"
                )
            else:
                alone[target.worker] = update.payload
        return alone, tuple(sorted(t.worker for t in here if t.worker not in alone))

    async def _outcome(
        self, last: tuple[asyncio.Future[bool], int, str], bucketed: bool
    ) -> bool | None:
        """Whether rank 0's ``last`` collective failed, or None if it did not end within
        :data:`LAST_COLLECTIVE_SHARE` of what is left of this plan's time (rank 0 waits
        in it still: a member that died as the group formed, say). A bucketed version
        (no copy of the learner's to read alone) waits until the hub gives the plan up.
        Either way, giving up is logged with what it waited for."""
        outcome, _, what = last
        limit_s = None if bucketed else plan_share_left(LAST_COLLECTIVE_SHARE)
        started = time.monotonic()
        try:
            done, _ = await asyncio.wait({outcome}, timeout=limit_s)
        except asyncio.CancelledError:
            logger.warning(
                "the hub gave this plan up after %.3g s waiting for rank 0 (%s) to end %s",
                time.monotonic() - started,
                self._name,
                what,
            )
            raise
        if done:
            return outcome.result()
        logger.warning(
            "rank 0 (%s) has not ended %s after %.3g s of this plan's wait (a member may "
            "have died as the group formed); this version's targets read the learner's "
            "copy alone",
            self._name,
            what,
            time.monotonic() - started,
        )
        return None

    def _alone_all(self, update: Any, targets: Sequence[ReceiverInfo]) -> dict[str, Any]:
        """Every target still registered reads the learner's copy alone (``update`` is a
        whole version: :meth:`_outcome` gives up on none other)."""
        return {t.worker: update.payload for t in targets if self._registered(t)}

    def _registered(self, target: ReceiverInfo) -> bool:
        """Whether ``target`` is its worker's registration now: the same process, and
        the same receiver in it."""
        known = self._receivers.get(target.worker)
        return known is not None and (known.process, known.attachment) == (
            target.process,
            target.attachment,
        )

    async def plan_pull(self, update: Any, spec: WeightSpec, receiver: ReceiverInfo) -> Any:
        """The learner's put, read directly; a bucketed version is served again by a
        receiver that got it, one stream per part (read from the broker)."""
        if not is_bucketed(update.payload):
            return update.payload
        return await plan_pull_parts(self._serving, update, spec, receiver, in_one_plan=False)

    async def _sit_out_absent(self, generation: int) -> None:
        """The members that never came to ``generation``'s rendezvous read the learner's
        copy alone for the group's timeout: a version planned meanwhile with them, the
        hub not knowing them behind yet, waited that long at its rendezvous again, and
        its other members' fallback came too late for the broadcast."""
        try:
            absent = await self._actor.absent_from.remote(generation)
        except ray.exceptions.RayActorError:
            return  # restarted: a new rendezvous anyway
        until = time.monotonic() + self._settings.timeout_s
        for worker in absent:
            self._sitting_out[worker] = until

    @staticmethod
    async def _collective_failed(job: Any) -> bool:
        """Did rank 0's collective ``job`` fail (or rank 0 die while running it, or its
        call raise: each plan would raise it again, and the transport stop for good)?"""
        try:
            return await job is not None
        except ray.exceptions.RayActorError:
            return True
        except Exception as err:  # a bug of rank 0's: the next generation starts afresh
            logger.warning("rank 0's last collective raised: %s", err)
            return True

    async def _rank0_store(self) -> StoreAddress:
        """Where rank 0's store listens now, asked every plan: a process-group actor that
        Ray restarted listens elsewhere. One that is restarting is waited for (the hub
        bounds the wait by the broadcast's timeout); one gone for good fails the plan."""
        waiting = False
        while True:
            try:
                return await self._actor.store_address.remote()
            except ray.exceptions.ActorUnavailableError as err:
                if not waiting:
                    logger.warning("waiting for Ray to restart %s: %s", self._name, err)
                    waiting = True
                await asyncio.sleep(_RESTART_POLL_S)
            except ray.exceptions.RayActorError as err:
                raise TransportError(
                    f"the process-group actor {self._name} is dead and will not restart: {err}"
                ) from err

    async def close(self) -> None:
        self._serving.close()
        if self._last_job is not None:  # no plan hears it any more
            self._last_job[0].cancel()
        try:
            await self._actor.close.remote()
        except ray.exceptions.RayActorError:
            pass  # already gone: nothing of it to close
        finally:
            ray.kill(self._actor)


def _alone(targets: Sequence[ReceiverInfo], copy: Any, sitting_out: set[str]) -> dict[str, Any]:
    """The learner's ``copy`` for each of ``targets`` that is behind or sits out."""
    return {t.worker: copy for t in targets if t.behind or t.worker in sitting_out}


def _start_rank0(name: str, settings: DistributedOptions) -> Any:
    """The hub's process-group actor (rank 0), on the hub's node, restarted by Ray."""
    options: dict[str, Any] = {
        "num_cpus": 0,
        "name": name,
        "max_restarts": -1,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=True
        ),
    }
    if settings.backend == "nccl":
        options["num_gpus"] = 1
    return ray.remote(actor_class(PROCESS_GROUP)).options(**options).remote(settings)

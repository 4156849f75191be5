"""A version sent in parts: sharded learners, each broadcasting its own slice.

Several learner processes (FSDP or pipeline ranks) each call
``hub.broadcast.remote(part_weights, version=step, part=rank, parts=world)``: every
part's bytes leave its own learner through its own transport sender, and the hub, once
every part of that version arrived (:mod:`raysync.part_assembly`), publishes one
version whose payload is :class:`Parts`, one :class:`Part` per learner. Nothing is
copied into one place: receivers read each part from where its learner left it, and
apply the version only when every part is here, at one safe point.

How each half of a transport meets a :class:`Parts` payload:

* hub process: :func:`plan_parts` plans each part as if it were a version of its own
  (a stream of its own for the planner's bookkeeping, :func:`part_stream`), unless the
  transport declares ``Transport.parts_in_one_plan`` (``distributed``, ``rpc``: their
  resource actor reads every part's put and sends the whole version at once);
* receiver process: :class:`PartedReceiver` wraps the transport's receiver: it fetches
  each part and hands the receiver core one tensor per spec entry, in spec order, and
  releases each part's payload with its own staged tensors.

A payload that is not :class:`Parts` passes through untouched.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from raysync.spec import WeightSpec
from raysync.transports.base import (
    ReceiverInfo,
    TransportError,
    TransportPlanner,
    TransportReceiver,
    Unplanned,
)

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


@dataclass(frozen=True)
class Part:
    """One learner's slice of a version: its transport's payload and what it carries."""

    payload: Any
    spec: WeightSpec  #: the tensors this part carries (in the wire dtype, if cast)


@dataclass(frozen=True)
class Parts:
    """A version sent in parts, in part order. The parts' names are disjoint and their
    union, sorted, is the version's spec (the hub checked it)."""

    parts: tuple[Part, ...]

    def in_spec_order(self, per_part: Sequence[Sequence[T]]) -> list[T]:
        """``per_part[i]`` holds one item per tensor of part ``i`` (in its spec order):
        all of them, in the whole version's spec order (names sorted)."""
        by_name: dict[str, T] = {}
        for part, items in zip(self.parts, per_part, strict=True):
            by_name.update(zip(part.spec.names, items, strict=True))
        return [by_name[name] for name in sorted(by_name)]


def part_stream(model: str, index: int, parts: int) -> str:
    """The model name a planner sees for one part: each part is a stream of its own in
    the planner's bookkeeping (its latest version, its relays, its holds)."""
    return f"{model}[part {index} of {parts}]"


def model_of_stream(stream: str) -> str:
    """The model a planner's stream name is of: ``stream`` itself, or the model whose
    part :func:`part_stream` named (what a receiver knows its model by)."""
    return stream_layout(stream)[0]


def stream_layout(stream: str) -> tuple[str, int]:
    """The model a planner's stream name is of, and in how many parts that stream's
    versions are sent (1: whole). Streams of one model in another number of parts are
    of another layout: its learners split it anew."""
    found = _PART_STREAM.fullmatch(stream)
    return (stream, 1) if found is None else (found.group(1), int(found.group(2)))


_PART_STREAM = re.compile(r"(.*)\[part \d+ of (\d+)\]", re.DOTALL)


def payloads_in(kept: Sequence[Any]) -> tuple[Any, ...]:
    """The transport payloads in ``kept`` (payloads a receiver still reads), each
    part of a :class:`Parts` on its own, as the planner handed them out."""
    out: list[Any] = []
    for payload in kept:
        if isinstance(payload, Parts):
            out.extend(part.payload for part in payload.parts)
        else:
            out.append(payload)
    return tuple(out)


async def plan_parts(
    planner: TransportPlanner,
    update: Any,
    spec: WeightSpec,
    targets: Sequence[ReceiverInfo],
    *,
    in_one_plan: bool,
) -> Mapping[str, Any]:
    """``planner.plan`` of ``update`` for ``targets``: a :class:`Parts` update is planned
    part by part (concurrently), each worker getting a :class:`Parts` of its planned
    payloads, unless ``in_one_plan``. Called in the hub process.

    A part that could not be planned for a worker (an :class:`Unplanned`, or its plan
    raised) stays in that worker's :class:`Parts` as the :class:`Unplanned`, beside the
    parts that were planned for it: its receiver lets those go (a planner may hold
    something for it, a slot or a stream's place) and fails, saying why
    (:class:`PartedReceiver`). A worker no part was planned for gets the first
    :class:`Unplanned` (nothing to let go: the hub fails it without a call)."""
    parted = update.payload
    if not isinstance(parted, Parts) or in_one_plan:
        return await planner.plan(update, spec, targets)
    planned = await _each_part(update, parted, lambda u, s: planner.plan(u, s, targets))
    count = len(parted.parts)
    payloads: dict[str, Any] = {}
    for target in targets:
        worker = target.worker
        per_part: list[Any] = []
        for index, plan in enumerate(planned):
            if isinstance(plan, BaseException):
                per_part.append(
                    Unplanned(f"part {index} of {count} could not be planned: {plan!r}")
                )
            elif worker in plan:
                per_part.append(plan[worker])
        if len(per_part) < count:
            continue  # it left meanwhile (its planners let go of what they hold for it)
        if all(isinstance(p, Unplanned) for p in per_part):
            payloads[worker] = per_part[0]
        else:
            payloads[worker] = Parts(
                tuple(Part(p, part.spec) for p, part in zip(per_part, parted.parts, strict=True))
            )
    return payloads


class PullPlanner(Protocol):
    """What :func:`plan_pull_parts` asks of ``planner``: a transport's planner, or the
    :class:`~raysync.transports.object_store.planner.BucketServing` of one."""

    async def plan_pull(self, update: Any, spec: WeightSpec, receiver: ReceiverInfo) -> Any: ...


async def plan_pull_parts(
    planner: PullPlanner,
    update: Any,
    spec: WeightSpec,
    receiver: ReceiverInfo,
    *,
    in_one_plan: bool,
) -> Any:
    """``planner.plan_pull`` of ``update`` for ``receiver``, part by part for a
    :class:`Parts` update unless ``in_one_plan``. Called in the hub process."""
    parted = update.payload
    if not isinstance(parted, Parts) or in_one_plan:
        return await planner.plan_pull(update, spec, receiver)
    planned = await _each_part(update, parted, lambda u, s: planner.plan_pull(u, s, receiver))
    count = len(parted.parts)
    failed = [(i, p) for i, p in enumerate(planned) if isinstance(p, BaseException)]
    if len(failed) == count:
        raise failed[0][1]
    return Parts(  # a part not planned: the puller lets the others go and fails, saying why
        tuple(
            Part(
                Unplanned(f"part {i} of {count} could not be planned: {p!r}")
                if isinstance(p, BaseException)
                else p,
                part.spec,
            )
            for i, (p, part) in enumerate(zip(planned, parted.parts, strict=True))
        )
    )


async def published_parts(
    planner: TransportPlanner, update: Any, spec: WeightSpec, *, in_one_plan: bool
) -> None:
    """``planner.published`` of ``update``, part by part for a :class:`Parts` update
    unless ``in_one_plan``. Called in the hub process."""
    parted = update.payload
    if not isinstance(parted, Parts) or in_one_plan:
        await planner.published(update, spec)
        return
    for outcome in await _each_part(update, parted, planner.published):
        if isinstance(outcome, BaseException):
            raise outcome


async def _each_part(
    update: Any, parted: Parts, plan: Callable[[Any, WeightSpec], Awaitable[T]]
) -> list[T | BaseException]:
    """``plan(part's update, part's spec)`` of every part, concurrently, in part order:
    each one's result, or the exception it raised (every part's plan runs to its end,
    so none is left placing holds for a plan nobody reads)."""
    outcomes = await asyncio.gather(
        *(plan(_part_update(update, i, parted), part.spec) for i, part in enumerate(parted.parts)),
        return_exceptions=True,
    )
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
            raise outcome  # cancelled, or the process is ending
    return outcomes


def _part_update(update: Any, index: int, parted: Parts) -> Any:
    """Part ``index`` of ``update`` as a version of its own stream."""
    return dataclasses.replace(
        update,
        model=part_stream(update.model, index, len(parted.parts)),
        payload=parted.parts[index].payload,
        wire_spec=None,
    )


class PartedReceiver(TransportReceiver):
    """A transport's receiver that also reads versions sent in parts (receiver process).

    Each part is fetched by the wrapped receiver with its own spec; a part that fails
    releases every part (those fetched before it with what they staged), so nothing
    stays held, and the release of that version without staged data that follows (the
    receiver's core releases what a failed fetch held) releases none again: a part
    released twice freed a shared-memory slot that another fetch of it still read.
    Each part is released with the very sequence its fetch returned (a transport may
    know its leases by it), and a version declined unread is declined part by part.
    """

    def __init__(self, inner: TransportReceiver) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        #: id of a version's staged list -> each part's staged sequence, as fetched
        self._parts_of: dict[int, list[Sequence[torch.Tensor]]] = {}
        #: the versions whose fetch failed, their parts released already, while alive
        self._released: weakref.WeakValueDictionary[int, Parts] = weakref.WeakValueDictionary()

    def fetch(self, payload: Any, spec: WeightSpec) -> Sequence[torch.Tensor]:
        if not isinstance(payload, Parts):
            return self.inner.fetch(payload, spec)
        unplanned = [
            (index, part.payload)
            for index, part in enumerate(payload.parts)
            if isinstance(part.payload, Unplanned)
        ]
        if unplanned:  # the hub could not plan a part for it: the others are let go
            for part in payload.parts:
                if not isinstance(part.payload, Unplanned):
                    self.inner.release(part.payload, None)
            with self._lock:
                self._released[id(payload)] = payload
            index, why = unplanned[0]
            raise TransportError(
                f"part {index} of {len(payload.parts)} of the version was not planned for "
                f"this receiver: {why.reason}"
            )
        fetched: list[Sequence[torch.Tensor]] = []
        try:
            for part in payload.parts:
                fetched.append(self.inner.fetch(part.payload, part.spec))
        except BaseException:
            for part, staged in zip(payload.parts, fetched, strict=False):
                self.inner.release(part.payload, staged)
            for part in payload.parts[len(fetched) :]:
                self.inner.release(part.payload, None)
            with self._lock:
                self._released[id(payload)] = payload
            raise
        whole = payload.in_spec_order(fetched)
        with self._lock:
            self._parts_of[id(whole)] = fetched
        return whole

    def check_intact(self, payload: Any) -> None:
        if not isinstance(payload, Parts):
            self.inner.check_intact(payload)
            return
        for part in payload.parts:
            self.inner.check_intact(part.payload)

    def release(self, payload: Any, staged: Sequence[torch.Tensor] | None) -> None:
        if not isinstance(payload, Parts):
            self.inner.release(payload, staged)
            return
        with self._lock:
            if staged is None and self._released.pop(id(payload), None) is payload:
                return  # its failed fetch released every part
            fetched = self._parts_of.pop(id(staged), None) if staged is not None else None
        for index, part in enumerate(payload.parts):
            if not isinstance(part.payload, Unplanned):  # nothing was planned to let go
                self.inner.release(part.payload, None if fetched is None else fetched[index])

    def decline(self, payload: Any) -> None:
        if not isinstance(payload, Parts):
            self.inner.decline(payload)
            return
        for part in payload.parts:
            if not isinstance(part.payload, Unplanned):  # nothing was planned to let go
                self.inner.decline(part.payload)

    def serve(self, payload: Any, tensors: Mapping[str, torch.Tensor], spec: WeightSpec) -> None:
        self.inner.serve(payload, tensors, spec)

    def close(self) -> None:
        self.inner.close()

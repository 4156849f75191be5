"""The hub's assembly of a version sent in parts (see :mod:`raysync.transports.parts`). Plain
Python, no Ray calls: owned by the hub actor and touched only from its event loop.

Each part is checked the moment it arrives, before any receiver is touched: against the
hub's spec of the model (its keys must be in it, shaped and typed alike), against the
parts already here (no key twice, the same number of parts, the same workers), and,
with the last part, the union against the whole spec (no key missing). A refusal names
the keys and fails the version for every part: nothing of it is ever applied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from raysync.errors import SpecMismatchError
from raysync.messages import BroadcastRequest
from raysync.spec import WeightSpec, keys_listed
from raysync.transports.parts import Part, Parts


class PartAssembly:
    """The parts of version ``version`` of ``model`` that reached the hub so far."""

    def __init__(self, model: str, version: int, parts: int, workers: tuple[str, ...] | None):
        self.model = model
        self.version = version
        self.parts = parts
        self.workers = workers
        self._arrived: dict[int, BroadcastRequest] = {}
        self._owner: dict[str, int] = {}  #: key -> the part that holds it

    @property
    def what(self) -> str:
        return f"version {self.version} of model {self.model!r} ({self.parts} parts)"

    @property
    def complete(self) -> bool:
        return len(self._arrived) == self.parts

    def arrived(self) -> tuple[int, ...]:
        """The parts arrived so far, in order."""
        return tuple(sorted(self._arrived))

    def drop_parts(self) -> None:
        """Let go of the parts' requests (their payloads: the learners' data) once the
        version failed: the hub keeps a failed version only to tell late parts why."""
        self._arrived.clear()
        self._owner.clear()

    def missing(self) -> list[int]:
        """The parts not arrived yet, in order."""
        return [i for i in range(self.parts) if i not in self._arrived]

    def agrees(self, request: BroadcastRequest) -> bool:
        """Whether ``request`` (a part) says what the parts here said: the number of
        parts and the workers (its keys are checked as it is added)."""
        workers = None if request.workers is None else tuple(request.workers)
        return request.parts == self.parts and _as_set(workers) == _as_set(self.workers)

    def fits(self, request: BroadcastRequest, hub_spec: WeightSpec | None) -> bool:
        """Whether :meth:`add` would take ``request`` in (asked of a part that names no
        model, among several: only a version it could be a part of hears its refusal)."""
        try:
            self._check(request, hub_spec)
        except ValueError:  # SpecMismatchError is one
            return False
        return True

    def add(self, request: BroadcastRequest, hub_spec: WeightSpec | None) -> None:
        """Take ``request`` (one part) in; raise, naming what is wrong, if it cannot be
        part of this version. ``hub_spec`` is the model's spec if the hub knows it."""
        self._check(request, hub_spec)
        self._arrived[request.part] = request
        self._owner.update(dict.fromkeys(request.spec.names, request.part))

    def _check(self, request: BroadcastRequest, hub_spec: WeightSpec | None) -> None:
        """Raise, naming what is wrong, unless :meth:`add` may take ``request``."""
        index = request.part
        name = f"part {index} of {self.what}"
        if request.parts != self.parts:
            raise ValueError(
                f"{name} says the version has {request.parts} parts; an earlier part "
                f"said {self.parts}"
            )
        if index in self._arrived:
            raise ValueError(f"{name} arrived twice")
        workers = None if request.workers is None else tuple(request.workers)
        if _as_set(workers) != _as_set(self.workers):  # listed in any order, as a whole one
            raise ValueError(
                f"{name} is for workers {workers}, an earlier part for {self.workers}: "
                "every part of a version goes to the same receivers"
            )
        if hub_spec is not None:
            _check_in_spec(request.spec, hub_spec, name)
        overlap: dict[int, list[str]] = {}
        for key in request.spec.names:
            if key in self._owner:
                overlap.setdefault(self._owner[key], []).append(key)
        if overlap:
            other, keys = min(overlap.items())
            raise SpecMismatchError(
                f"parts {other} and {index} of {self.what} both hold key(s) "
                f"{keys_listed(keys)}: each key belongs to exactly one part"
            )

    def request(self, hub_spec: WeightSpec | None) -> BroadcastRequest:
        """The whole version as one broadcast, once :attr:`complete`: the whole spec, one
        :class:`~raysync.transports.parts.Parts` payload per hand-off every part carries. Raises
        SpecMismatchError naming the keys the parts leave out of ``hub_spec``."""
        ordered = [self._arrived[i] for i in range(self.parts)]
        spec = _union(r.spec for r in ordered)
        if hub_spec is not None:
            # Parts that came before the hub knew the model's spec were not checked then.
            for index, part in enumerate(ordered):
                _check_in_spec(part.spec, hub_spec, f"part {index} of {self.what}")
            if spec.names != hub_spec.names:
                missing = sorted(set(hub_spec.names) - set(spec.names))
                raise SpecMismatchError(
                    f"the {self.parts} parts of {self.what} do not add up to the model: "
                    f"missing key(s) {keys_listed(missing)}"
                )
        hand_offs = self._common_hand_offs()
        payloads = {
            hand_off: Parts(
                tuple(Part(r.payloads[hand_off], r.wire_spec or r.spec) for r in ordered)
            )
            for hand_off in sorted(hand_offs)
        }
        cast = any(r.wire_spec is not None for r in ordered)
        first = ordered[0]
        return dataclasses.replace(
            first,
            model=self.model,
            version=self.version,
            spec=spec,
            payloads=payloads,
            wire_spec=_union(r.wire_spec or r.spec for r in ordered) if cast else None,
            learner_seconds=max(r.learner_seconds for r in ordered),
            part=0,
            parts=1,
            bucket_bytes=next((r.bucket_bytes for r in ordered if r.bucket_bytes), None),
        )

    def unread_payloads(self) -> list[object]:
        """Once :attr:`complete`: the payloads of hand-offs that not every part carries
        (the ranks' routes differed: a receiver of a new transport joined between their
        broadcasts). :meth:`request` leaves them out, and nobody reads them: their
        transports are told so (a bucketed one's learner stops streaming it)."""
        common = self._common_hand_offs()
        return [p for r in self._arrived.values() for h, p in r.payloads.items() if h not in common]

    def _common_hand_offs(self) -> set[str]:
        """The hand-offs every part arrived carries: the whole version goes by these."""
        return set.intersection(*(set(r.payloads) for r in self._arrived.values()))


def _check_in_spec(part: WeightSpec, whole: WeightSpec, name: str) -> None:
    """Raise SpecMismatchError unless every key of ``part`` is in ``whole``, alike."""
    known = {t.name: t for t in whole.tensors}
    unknown = [t.name for t in part.tensors if t.name not in known]
    if unknown:
        raise SpecMismatchError(
            f"{name} holds key(s) the model does not have: {keys_listed(unknown)}"
        )
    for tensor in part.tensors:
        expected = known[tensor.name]
        if expected != tensor:
            raise SpecMismatchError(
                f"{name}: key {tensor.name!r} has {tensor.describe()}, the model has "
                f"{expected.describe()}"
            )


def _as_set(workers: tuple[str, ...] | None) -> frozenset[str] | None:
    return None if workers is None else frozenset(workers)


def _union(specs: Iterable[WeightSpec]) -> WeightSpec:
    """The disjoint specs as one, sorted by name."""
    tensors = [t for spec in specs for t in spec.tensors]
    return WeightSpec(tuple(sorted(tensors, key=lambda t: t.name)))

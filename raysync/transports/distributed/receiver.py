"""Receiver process: the distributed receiver, a member of one generation at a time."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError, TransportReceiver
from raysync.transports.bucket_relay import (
    RelayedBucket,
    finish,
    leave,
    place,
    read_bucket_now,
    relay_plan,
)
from raysync.transports.distributed.group import (
    bucket_timeout_s,
    join_group,
    run_broadcast,
    staging_device,
)
from raysync.transports.distributed.wire import HEADER_BYTES, MAGIC, Generation, GroupPayload
from raysync.transports.object_store.receiver import ObjectStoreReceiver
from raysync.transports.parts import PartedReceiver
from raysync.transports.staging import StagingPool
from raysync.transports.staging import staging_device as process_staging_device

logger = logging.getLogger(__name__)


class DistributedReceiver(TransportReceiver):
    """Runs in the receiver process: a member of at most one generation at a time."""

    def __init__(self, worker: str | None = None, formed_before: int = 0) -> None:
        """``formed_before``: the last generation the hub formed before this receiver
        registered; it takes no part in those (:class:`MemberInfo`)."""
        self._formed_before = formed_before
        self._turn = threading.Condition()
        self._generation: Generation | None = None
        self._group: Any = None
        self._next_seq = 0
        #: generation number -> why it broke here, for the current generation and later
        self._broken: dict[int, str] = {}
        self._closed = False
        #: the learner's put(s), or a bucket stream served to this receiver
        self._pull = PartedReceiver(ObjectStoreReceiver(worker))
        process_staging_device()  # asked first here, in the thread that made the receiver
        #: id -> staged tensors a fallback read from the learner's copy (released there)
        self._read_from_source: dict[int, Sequence[torch.Tensor]] = {}
        #: (generation, collective) of each version a fetch was called for, until its
        #: release: one released and not among them was never read (:meth:`_sit_in`)
        self._fetched: set[tuple[int, int]] = set()
        self._device = torch.device("cpu")  #: where bucketed versions are staged
        self._staging: StagingPool[torch.Tensor] = StagingPool(self._staging_buffer)

    @property
    def generation(self) -> int:
        """The number of the generation this receiver is a member of (0: none yet)."""
        return 0 if self._generation is None else self._generation.number

    def fetch(self, payload: Any, spec: WeightSpec) -> Sequence[torch.Tensor]:
        if not isinstance(payload, GroupPayload):  # pull mode: from the object store
            return self._pull.fetch(payload, spec)
        self._fetched.add(_collective_of(payload))
        if payload.buckets:
            return self._fetch_buckets(payload, spec)
        try:
            return self._receive(payload, spec)
        except TransportError as err:
            # One member's death must not cost the others the version: read the copy
            # rank 0 was sending from instead.
            logger.warning("%s; reading the learner's object-store copy instead", err)
            try:
                staged = self._pull.fetch(payload.source, spec)
            except TransportError as fallback:
                raise TransportError(f"{err}; and then {fallback}") from fallback
            self._read_from_source[id(staged)] = staged
            return staged

    def release(self, payload: Any, staged: Sequence[torch.Tensor] | None) -> None:
        """Let ``staged`` go; a version handed back unread (its receiver failed it before
        fetching) has its collectives entered all the same (:meth:`_sit_in`)."""
        if not isinstance(payload, GroupPayload):
            self._pull.release(payload, staged)
            return
        try:
            self._fetched.remove(_collective_of(payload))
        except KeyError:
            self._sit_in(payload)
            return
        if staged is not None and self._read_from_source.pop(id(staged), None) is not None:
            self._pull.release(payload.source, staged)  # the parts it read, if in parts
        else:
            self._staging.release(staged)  # a bucketed version's staging buffer

    def serve(self, payload: Any, tensors: Mapping[str, torch.Tensor], spec: WeightSpec) -> None:
        self._pull.serve(payload, tensors, spec)

    def _fetch_buckets(self, payload: GroupPayload, spec: WeightSpec) -> Sequence[torch.Tensor]:
        """A bucketed version: one collective per bucket into a staging buffer; if one
        fails (a member died), the rest read from the hub's bucket broker instead."""
        settings = payload.generation.settings
        plan = relay_plan(payload.source, spec)
        self._device = staging_device(settings)

        def write(buffer: torch.Tensor) -> Sequence[torch.Tensor]:
            failed_at, err = self._receive_buckets(payload, plan, buffer)
            if err is not None:
                logger.warning(
                    "%s; reading buckets %d to %d from the hub's bucket broker instead",
                    err,
                    failed_at + 1,
                    len(plan),
                )
                wait_s = settings.timeout_s
                read = False
                try:
                    for bucket in plan[failed_at:]:
                        place(
                            buffer, bucket.pieces, read_bucket_now(bucket, payload.worker, wait_s)
                        )
                    read = True
                except TransportError as fallback:
                    raise TransportError(f"{err}; and then {fallback}") from fallback
                finally:  # only a reader that holds it whole may serve it to a late joiner
                    (finish if read else leave)(payload.source, payload.worker)
            return self._staging.views(buffer, PackedLayout.of(spec))

        return self._staging.fill(spec, write)

    def _receive_buckets(
        self, payload: GroupPayload, plan: list[RelayedBucket], buffer: torch.Tensor
    ) -> tuple[int, TransportError | None]:
        """Enter one collective per bucket of ``plan`` and place each into ``buffer``:
        ``(0, None)``, or the index of the bucket that failed and why."""
        generation, settings = payload.generation, payload.generation.settings
        size = HEADER_BYTES + max(bucket.nbytes for bucket in plan)
        deadline = time.monotonic() + settings.timeout_s
        index = 0
        with self._turn:
            try:
                self._wait_for_turn(payload, deadline)
            except TransportError as err:
                return 0, err  # its collectives run without it: all from the broker
            try:
                if self._generation != generation:
                    self._switch_to(generation, payload.rank)
                incoming = torch.empty(size, dtype=torch.uint8, device=self._device)
                limit_s = bucket_timeout_s(settings, payload.source)
                for index, bucket in enumerate(plan):
                    run_broadcast(self._group, incoming, settings, agree=True, timeout_s=limit_s)
                    got = incoming[:HEADER_BYTES].cpu().view(torch.int64)[:5].tolist()
                    expected = [MAGIC, generation.number, payload.seq, size, index + 1]
                    if got != expected:
                        raise TransportError(
                            f"received (generation, collective, bytes, bucket) = "
                            f"{tuple(got[1:])}, expected {tuple(expected[1:])}: the group "
                            "is out of step"
                        )
                    place(
                        buffer,
                        bucket.pieces,
                        [incoming[HEADER_BYTES : HEADER_BYTES + bucket.nbytes]],
                    )
                return 0, None
            except Exception as err:
                self._break(generation, f"collective {payload.seq} failed: {err}")
                return index, TransportError(
                    f"rank {payload.rank} could not receive bucket {index + 1} of {len(plan)} "
                    f"(collective {payload.seq} of process-group generation "
                    f"{generation.number}, {settings.backend}, {generation.world_size} "
                    f"ranks): {err}"
                )
            finally:
                self._next_seq = max(self._next_seq, payload.seq + 1)
                self._turn.notify_all()

    def _sit_in(self, payload: GroupPayload) -> None:
        """Enter ``payload``'s collectives, though this receiver will not read the version
        (it failed it before fetching: its model was replaced by one of another shape,
        say), and drop what arrives. Each collective waits for every member: without
        this one the others waited the group's timeout and read the learner's copy
        instead, at each version it failed so, each time in a new generation. A failure
        is logged: the receiver's ack already says why it has not the version."""
        generation, settings = payload.generation, payload.generation.settings
        deadline = time.monotonic() + settings.timeout_s
        if payload.buckets:
            # Not a reader of the version's stream: rank 0 does not name it among those
            # that got the version (and may serve it to a late joiner), nor, if a
            # collective fails, among the members that read the rest from the broker.
            leave(payload.source, payload.worker)
        with self._turn:
            try:
                self._wait_for_turn(payload, deadline)
            except TransportError as err:  # not its turn: it moved on, or never came
                _log_sat_out(payload, err)
                return
            try:
                if self._generation != generation:
                    self._switch_to(generation, payload.rank)
                scratch = torch.empty(
                    payload.buffer_bytes, dtype=torch.uint8, device=staging_device(settings)
                )
                if payload.buckets:
                    limit_s = bucket_timeout_s(settings, payload.source)
                    for _ in range(payload.buckets):
                        run_broadcast(self._group, scratch, settings, agree=True, timeout_s=limit_s)
                else:
                    run_broadcast(self._group, scratch, settings)
            except Exception as err:
                self._break(generation, f"collective {payload.seq} failed: {err}")
                _log_sat_out(payload, err)
            finally:
                self._next_seq = max(self._next_seq, payload.seq + 1)
                self._turn.notify_all()

    def _staging_buffer(self, spec: WeightSpec) -> torch.Tensor:
        return torch.empty(PackedLayout.of(spec).nbytes, dtype=torch.uint8, device=self._device)

    def _receive(self, payload: GroupPayload, spec: WeightSpec) -> Sequence[torch.Tensor]:
        """Enter ``payload``'s collective and return views of what rank 0 sent."""
        generation = payload.generation
        deadline = time.monotonic() + generation.settings.timeout_s
        failure: TransportError | None = None
        with self._turn:
            self._wait_for_turn(payload, deadline)
            try:
                if self._generation != generation:
                    self._switch_to(generation, payload.rank)
                layout = PackedLayout.of(spec, HEADER_BYTES)
                buffer = torch.empty(
                    layout.nbytes, dtype=torch.uint8, device=staging_device(generation.settings)
                )
                run_broadcast(self._group, buffer, generation.settings)
            except Exception as err:
                self._break(generation, f"collective {payload.seq} failed: {err}")
                failure = TransportError(
                    f"rank {payload.rank} could not receive collective {payload.seq} of "
                    f"process-group generation {generation.number} "
                    f"({generation.settings.backend}, {generation.world_size} ranks): {err}; "
                    "a member may have died or not entered the broadcast within "
                    f"{generation.settings.timeout_s:g} s"
                )
            finally:
                self._next_seq = max(self._next_seq, payload.seq + 1)
                self._turn.notify_all()
        if failure is not None:
            # Raised here, with no cause: the collective's error holds its frames, and
            # they the group this receiver left, whose connections stay open while it
            # lives (gloo's shutdown closes none): its peers waited on it for the
            # group's timeout, through this receiver's whole fallback read.
            raise failure
        got = buffer[:HEADER_BYTES].cpu().view(torch.int64)[:4].tolist()
        expected = [MAGIC, generation.number, payload.seq, layout.nbytes]
        if got != expected:
            raise TransportError(
                f"rank {payload.rank} received a buffer for (generation, collective, bytes) "
                f"= {tuple(got[1:])}, expected {tuple(expected[1:])}: the group is out of step"
            )
        return layout.views(buffer)

    def _wait_for_turn(self, payload: GroupPayload, deadline: float) -> None:
        """Collectives run in sequence order; a threaded actor may be handed them out
        of order. Called with ``self._turn`` held."""
        number = payload.generation.number
        while True:
            if self._closed:
                raise TransportError(
                    f"this receiver closed before collective {payload.seq} of process-group "
                    f"generation {number} was its turn"
                )
            if number in self._broken:
                raise TransportError(
                    f"process-group generation {number} broke on this receiver earlier "
                    f"({self._broken[number]}); collective {payload.seq} cannot run"
                )
            if number <= self._formed_before:  # its collective 0 was another's to enter
                raise TransportError(
                    f"process-group generation {number} was formed before this receiver "
                    f"registered (planned for the registration it replaced): collective "
                    f"{payload.seq} is not its to enter"
                )
            current = self.generation
            if number < current or (number == current and payload.seq < self._next_seq):
                raise TransportError(
                    f"collective {payload.seq} of process-group generation {number} arrived "
                    f"after this receiver moved on to generation {current}, collective "
                    f"{self._next_seq}"
                )
            if payload.seq == (0 if number > current else self._next_seq):
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                first = 0 if number > current else self._next_seq
                raise TransportError(
                    f"collective {payload.seq} of process-group generation {number} waited "
                    f"{payload.generation.settings.timeout_s:g} s for its collective "
                    f"{first} to be delivered to this receiver first"
                )
            self._turn.wait(remaining)

    def _switch_to(self, generation: Generation, rank: int) -> None:
        self._leave()
        self._generation = generation
        self._next_seq = 0
        # An older generation's collective is turned away as older from now on.
        self._broken = {n: why for n, why in self._broken.items() if n >= generation.number}
        self._group = join_group(generation, rank)

    def _break(self, generation: Generation, reason: str) -> None:
        self._broken[generation.number] = reason
        if self._generation == generation:
            self._leave()

    def _leave(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.shutdown()

    def close(self) -> None:
        """Leave the group and let the staging buffers go; a fetch waiting for its turn
        hears it now (it waited out its deadline)."""
        with self._turn:
            self._leave()
            self._generation = None
            self._closed = True
            self._turn.notify_all()
        self._staging.close()
        self._pull.close()


def _collective_of(payload: GroupPayload) -> tuple[int, int]:
    """Which collective (generation, sequence number) carries ``payload``'s version."""
    return payload.generation.number, payload.seq


def _log_sat_out(payload: GroupPayload, err: Exception) -> None:
    logger.warning(
        "rank %d could not sit in collective %d of process-group generation %d (a version "
        "it does not read): %s",
        payload.rank,
        payload.seq,
        payload.generation.number,
        err,
    )

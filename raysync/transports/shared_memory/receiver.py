"""Receiver process: the shared-memory receiver, viewing its node's slot read-only."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError, TransportReceiver
from raysync.transports.object_store.bucket_stream import BucketStream
from raysync.transports.object_store.receiver import ObjectStoreReceiver
from raysync.transports.shared_memory.segments import Mappings, open_segment_fd
from raysync.transports.shared_memory.wire import (
    HEADER_BYTES,
    OWNER_NAMESPACE,
    SharedMemoryPayload,
    SharedMemoryReceiverInfo,
    Slot,
    read_seq,
)

#: (worker, owner pid, seq) -> how many fetches of that version by this process's
#: receivers of that worker are not released yet. Its owner holds a slot once per
#: worker: a version handed to this process twice (a delivery tried again, a catch-up
#: beside a broadcast of it) is released when the last of them is, not when the first
#: one (superseded by the second) is. Per process, not per receiver: a worker that
#: registers again opens a new receiver, and the one it replaced may still have the
#: version staged (waiting for a safe point) that the new one fetched again for the
#: welcome's catch-up; each counted apart, the first release (the staged one,
#: superseded) let go of the owner's one hold while the other fetch was still unread.
_LEASES: dict[tuple[str, int, int], int] = {}
_LEASES_LOCK = threading.Lock()


class SharedMemoryReceiver(TransportReceiver):
    """Receiver side: views of this node's slot; release it after the copy (or decline
    it, never read)."""

    def __init__(self, info: SharedMemoryReceiverInfo) -> None:
        self._worker = info.worker
        self._owner_name = info.owner
        self._owner: tuple[int, Any] | None = None  #: (pid, handle) of the owner last used
        self._board = info.board
        self._board_fd: int | None = None  #: the board, opened on the first release
        #: Guards ``_board_fd``: two threads releasing at once (a version superseded on
        #: the host's loop, another at the hub watch's safe point) each opened it.
        self._board_lock = threading.Lock()
        self._closed = False
        self._node_id = ray.get_runtime_context().get_node_id()
        self._mappings = Mappings(writable=False)
        #: Bucketed versions: read from the bucket broker into a private staging buffer.
        self._streams = ObjectStoreReceiver(info.worker)

    def fetch(
        self, payload: SharedMemoryPayload | BucketStream, spec: WeightSpec
    ) -> Sequence[torch.Tensor]:
        if isinstance(payload, BucketStream):
            return self._streams.fetch(payload, spec)
        slot = payload.slot
        if slot.node_id != self._node_id:
            raise TransportError(
                f"the update's shared-memory slot is on node {slot.node_id}, but receiver "
                f"{self._worker} runs on node {self._node_id}; the hub plans a slot per node, "
                "so this payload was not planned for this receiver"
            )
        layout = PackedLayout.of(spec, HEADER_BYTES)
        if layout.nbytes != slot.nbytes:
            raise TransportError(
                f"slot of {slot.nbytes} bytes does not fit the spec's layout of "
                f"{layout.nbytes} bytes ({spec.summary()})"
            )
        self._check_seq(slot, "read it")
        views = self._mappings.views(slot, layout)
        with _LEASES_LOCK:
            key = (self._worker, slot.pid, slot.seq)
            _LEASES[key] = _LEASES.get(key, 0) + 1
        return views

    def check_intact(self, payload: SharedMemoryPayload | BucketStream) -> None:
        """The slot's views are what a copy-mode receiver stages: its owner keeps the
        slot while this worker holds it, but a hold can be lost while a version waits
        for its safe point (the hub forgot this worker, or it registered again: its
        holds went with the old registration). The slot's header says whether the
        learner wrote another version into it since."""
        if isinstance(payload, SharedMemoryPayload):
            self._check_seq(payload.slot, "applied it")

    def _check_seq(self, slot: Slot, before: str) -> None:
        seq = read_seq(self._mappings.buffer(slot).numpy())
        if seq != slot.seq:
            raise TransportError(
                f"shared-memory slot of receiver {self._worker} holds sequence "
                f"{seq}, expected {slot.seq}: it was rewritten before this "
                f"receiver {before} (its hold was lost: did the hub forget it, or did it "
                "register again, meanwhile?)"
            )

    def release(
        self, payload: SharedMemoryPayload | BucketStream, staged: Sequence[torch.Tensor] | None
    ) -> None:
        if isinstance(payload, BucketStream):
            self._streams.release(payload, staged)
            return
        slot = payload.slot
        with _LEASES_LOCK:  # one of its fetches ends (or one that failed)
            key = (self._worker, slot.pid, slot.seq)
            if staged is None:  # never fetched (turned down unread, or the fetch failed)
                if _LEASES.get(key, 0) > 0:
                    # A fetch of the same version still reads it (a zero-copy model
                    # lives there, delivered again): the owner's one hold for this
                    # worker goes with that fetch's release, not now.
                    return
            else:
                left = _LEASES.pop(key, 0) - 1
                if left > 0:
                    _LEASES[key] = left
                    return
        if staged is None and not payload.placement:
            # Its learner's own call, turned down unread: the hub may deliver this very
            # slot itself next, under a number of its own (another learner's took this
            # one's), and that hold must stay. By call: a cell on the board says only
            # that the version was released, not which delivery of it.
            owner = self._owner_of(slot)
            if owner is not None:
                owner.release_unread.remote(slot.pid, slot.seq, self._worker)
            return
        if self._released_on_board(slot):
            return
        owner = self._owner_of(slot)
        if owner is not None:  # else it died, and its holds with it
            # The owner ignores it if it is not the slot's owner (restarted meanwhile).
            owner.release.remote(slot.pid, slot.seq, self._worker)

    def decline(self, payload: SharedMemoryPayload | BucketStream) -> None:
        """Take back the hold the hub's delivery of ``payload`` (its ``placement``) took
        for this worker, unread, and that one alone: the owner holds a slot once per
        worker, and another delivery of the same version (a pull tried again, the hub's
        delivery of it) held it for this worker too, and may be read yet (a release
        let go of that one hold). No fetch of it counts in ``_LEASES``. A payload no
        delivery held (a learner's own) is released unread; a bucketed version is let
        go of as the object store's receiver declines it
        (:meth:`~raysync.transports.object_store.receiver.ObjectStoreReceiver.decline`:
        a stream served for this read alone is given up, the version's own is not)."""
        if isinstance(payload, BucketStream):
            self._streams.decline(payload)
            return
        if not payload.placement:
            self.release(payload, None)
            return
        slot = payload.slot
        owner = self._owner_of(slot)
        if owner is not None:  # else it died, and its holds with it
            # Sent after the hub's answer, which came once the hold was taken: the
            # owner finds it (a restarted owner ignores a slot not its own).
            owner.withdraw.remote(slot.pid, slot.seq, (self._worker,), payload.placement)

    def _owner_of(self, slot: Slot) -> Any | None:
        """The handle of the owner that gave out ``slot`` (looked up by name again once
        another process holds that name); None if no owner runs under it."""
        if self._owner is None or self._owner[0] != slot.pid:
            try:
                handle = ray.get_actor(self._owner_name, namespace=OWNER_NAMESPACE)
            except ValueError:
                return None
            self._owner = (slot.pid, handle)
        return self._owner[1]

    def _released_on_board(self, slot: Slot) -> bool:
        """Release ``slot`` on this receiver's row of its owner's board; False if it
        has none there (no row or column, or the slot is a restarted owner's), or if
        its cell still holds this version's release, unread (a version delivered
        twice, released twice before the owner looked: one cell would count once, and
        the second hold was kept for good; by call, each counts).

        A cell holding a newer version's release, unread, is left as it is: this one
        is of a version that segment no longer holds (a late release of one turned
        down), and written over that release, the newer version's hold was kept."""
        with self._board_lock:
            board = self._board
            if board is None or slot.column < 0 or board.segment.pid != slot.pid:
                return False
            fd = self._board_fd
            if fd is None:
                try:
                    fd = open_segment_fd(board.segment, writable=True)
                except TransportError:
                    self._board = None  # its owner died: release by call (to its successor)
                    return False
            try:
                offset = board.offset(slot.column)
                unread = int.from_bytes(os.pread(fd, 8, offset), "little")
                if unread == slot.seq:
                    return False
                if unread < slot.seq:
                    # A system call: what this process read from the slot is read before
                    # the owner can see the release.
                    os.pwrite(fd, slot.seq.to_bytes(8, "little"), offset)
            finally:
                if self._closed:  # a version its zero-copy model moved on from, released late
                    os.close(fd)
                else:
                    self._board_fd = fd
            return True

    def serve(self, payload: Any, tensors: Mapping[str, torch.Tensor], spec: WeightSpec) -> None:
        self._streams.serve(payload, tensors, spec)

    def close(self) -> None:
        """Close the board and the mappings; a release after (of the version a zero-copy
        model lives in, when it moves on) opens the board for that write alone."""
        with self._board_lock:
            self._closed = True
            if self._board_fd is not None:
                os.close(self._board_fd)
                self._board_fd = None
        self._mappings.clear()
        self._streams.close()

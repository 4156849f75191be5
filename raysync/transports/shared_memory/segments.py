"""Learner and receiver processes: mapping an owner's segments into this process."""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Sequence

import torch

from raysync.copies import Viewed, viewed
from raysync.layout import PackedLayout
from raysync.transports.base import TransportError
from raysync.transports.shared_memory.wire import RETIRED_SEQ, TOKEN_BYTES, Slot, read_seq


def open_segment_fd(slot: Slot, writable: bool) -> int:
    """A descriptor of ``slot``'s segment in this process (``/proc/<owner>/fd/<fd>``),
    its token checked; TransportError if the owner is gone or another."""
    path = f"/proc/{slot.pid}/fd/{slot.fd}"
    try:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except OSError as err:
        raise TransportError(
            f"cannot open shared-memory segment {path} of the owner on node {slot.node_id} "
            f"({err.strerror}); the owner may have died or runs as another user"
        ) from err
    if os.pread(fd, TOKEN_BYTES, 0) != slot.token:
        os.close(fd)
        raise TransportError(
            f"{path} is not the shared-memory segment it should be (token mismatch); "
            f"the owner on node {slot.node_id} may have been replaced"
        )
    return fd


def _open(slot: Slot, writable: bool) -> torch.Tensor:
    """Map ``slot``'s segment (shared; read-only for readers) as a uint8 tensor, page
    tables filled up front; check its token."""
    fd = open_segment_fd(slot, writable)
    try:
        segment = mmap.mmap(
            fd,
            slot.nbytes,
            flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
            prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0),
        )
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        # Readers map the segment read-only and only ever read from it.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(segment, dtype=torch.uint8)


class Mappings:
    """Segments this process has mapped, by token, and the typed views of each in the
    layout it was last used with. Mappings of a replaced owner (another pid), and of
    segments their owner freed, are dropped when a new segment is mapped."""

    def __init__(self, writable: bool) -> None:
        self._writable = writable
        self._buffers: dict[bytes, tuple[int, torch.Tensor]] = {}
        self._views: dict[bytes, tuple[PackedLayout, Sequence[torch.Tensor]]] = {}

    def buffer(self, slot: Slot) -> torch.Tensor:
        known = self._buffers.get(slot.token)
        if known is not None:
            return known[1]
        # Let go of the mappings of a replaced owner's segments and of segments the owner
        # freed (their learner left): unmapped once no tensor of this process views them.
        self._buffers = {
            t: e
            for t, e in self._buffers.items()
            if e[0] == slot.pid and read_seq(e[1].numpy()) != RETIRED_SEQ
        }
        self._views = {t: v for t, v in self._views.items() if t in self._buffers}
        buffer = _open(slot, self._writable)
        self._buffers[slot.token] = (slot.pid, buffer)
        return buffer

    def views(self, slot: Slot, layout: PackedLayout) -> Sequence[torch.Tensor]:
        """``layout``'s tensors viewing ``slot``'s segment (:meth:`PackedLayout.views`),
        with their NumPy views (:func:`raysync.copies.viewed`, which a receiver copies
        from), made once per segment and layout: a slot is written and read once per
        version, and a model of 1000 tensors took ~1.4 ms to view each time, in the
        learner and in every receiver. Each call gets a sequence of its own."""
        buffer = self.buffer(slot)
        known = self._views.get(slot.token)
        if known is None or known[0] is not layout:
            known = self._views[slot.token] = (layout, viewed(layout.views(buffer)))
        views = known[1]
        return views.alias() if isinstance(views, Viewed) else list(views)

    def clear(self) -> None:
        self._buffers.clear()
        self._views.clear()

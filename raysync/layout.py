"""PackedLayout: one version's tensors back to back in a single uint8 buffer.

Transports that move a version as one block (a shared-memory segment, a registered
NIXL region, one collective broadcast) pack the tensors into such a buffer and give
receivers typed views of their copy. A buffer may start with a ``header_bytes`` header
that the transport keeps for itself (a sequence number, a stamp); every tensor then
follows at a 64-byte aligned offset, in spec order. The layout is a pure function of
the spec, so both sides compute it and only the spec travels.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from raysync.copies import copy_all
from raysync.spec import WeightSpec

#: Every tensor starts at a multiple of this many bytes (a cache line; any dtype's itemsize).
ALIGNMENT = 64
#: The header size the transports in this package reserve at the start of a buffer.
HEADER_BYTES = 64


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class PackedLayout:
    """Byte offsets of a spec's tensors, in spec order, in one buffer of ``nbytes``."""

    spec: WeightSpec
    header_bytes: int
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, spec: WeightSpec, header_bytes: int = 0) -> PackedLayout:
        """The layout of ``spec`` after a header of ``header_bytes`` (rounded up to 64);
        the same instance for the same spec while it is recent (senders and receivers
        ask on every version)."""
        return _layout_of(spec, header_bytes)

    def pack(
        self,
        tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
        buffer: torch.Tensor,
        typed: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Copy ``tensors`` into their places in the uint8 ``buffer`` (any device).

        ``tensors`` is a mapping by spec name, or a sequence in spec order; each is
        contiguous, of its spec dtype and shape or already a uint8 view of its bytes.
        ``typed``: :meth:`views` of ``buffer``, if the caller keeps them.
        :func:`raysync.copies.copy_all` moves them all, on every core torch uses: a
        model of 1000 small tensors pays no round of slicing and viewing per tensor.
        """
        sources = (
            [tensors[entry.name] for entry in self.spec.tensors]
            if isinstance(tensors, Mapping)
            else list(tensors)
        )
        if len(sources) != len(self.spec.tensors):
            raise ValueError(
                f"pack got {len(sources)} tensors for a layout of {len(self.spec.tensors)}"
            )
        typed = self.views(buffer) if typed is None else typed
        destinations = []
        for index, (source, view) in enumerate(zip(sources, typed, strict=True)):
            if source.dtype == view.dtype and source.shape == view.shape:
                destinations.append(view)
                continue
            flat = source.reshape(-1)
            sources[index] = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
            offset, nbytes = self.offsets[index], self.spec.tensors[index].nbytes
            destinations.append(buffer[offset : offset + nbytes])
        copy_all(destinations, sources, self.spec)

    def byte_views(
        self, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The bytes of ``tensors`` (as in :meth:`pack`) as flat uint8 views, spec order."""
        sources = (
            [tensors[entry.name] for entry in self.spec.tensors]
            if isinstance(tensors, Mapping)
            else tensors
        )
        flat = [source.reshape(-1) for source in sources]
        return [t if t.dtype == torch.uint8 else t.view(torch.uint8) for t in flat]

    def pack_range(
        self,
        sources: Sequence[torch.Tensor],
        buffer: torch.Tensor,
        start: int,
        end: int,
        copy: Callable[[torch.Tensor, torch.Tensor], object] = torch.Tensor.copy_,
    ) -> None:
        """Copy the bytes that fall in ``[start, end)`` of this layout from ``sources``
        (:meth:`byte_views`) into the same bytes of ``buffer``, a whole buffer of this
        layout: a version written piece by piece, with readers following behind.
        ``copy(destination, source)`` moves each piece."""
        first = max(bisect.bisect_right(self.offsets, start) - 1, 0)
        for index in range(first, len(self.offsets)):
            offset = self.offsets[index]
            if offset >= end:
                break
            low, high = max(start, offset), min(end, offset + self.spec.tensors[index].nbytes)
            if low < high:
                copy(buffer[low:high], sources[index][low - offset : high - offset])

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """One tensor per spec entry, in spec order, viewing the uint8 ``buffer`` (no copy).

        One ``as_strided`` per tensor on a view of the buffer in that tensor's dtype
        (offsets are 64-byte aligned, so every dtype's elements line up; the buffer
        itself must start at a multiple of each dtype's itemsize in its storage).
        """
        buffer = buffer[: self.nbytes]
        typed: dict[torch.dtype, torch.Tensor] = {}
        views = []
        for offset, entry, strides in zip(
            self.offsets, self.spec.tensors, self._strides, strict=True
        ):
            whole = typed.get(entry.dtype)
            if whole is None:
                whole = typed[entry.dtype] = buffer.view(entry.dtype)
            start = whole.storage_offset() + offset // entry.dtype.itemsize
            views.append(whole.as_strided(entry.shape, strides, start))
        return views

    @cached_property
    def _strides(self) -> tuple[tuple[int, ...], ...]:
        """Each tensor's contiguous strides, in elements."""
        return tuple(_contiguous_strides(entry.shape) for entry in self.spec.tensors)


@functools.lru_cache(maxsize=32)
def _layout_of(spec: WeightSpec, header_bytes: int) -> PackedLayout:
    offsets, end = [], _aligned(header_bytes)
    for entry in spec.tensors:
        offsets.append(end)
        end = _aligned(end + entry.nbytes)
    return PackedLayout(spec, _aligned(header_bytes), tuple(offsets), max(end, ALIGNMENT))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

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
        """The layout of ``spec`` after a header of ``header_bytes`` (rounded up to 64)."""
        offsets, end = [], _aligned(header_bytes)
        for entry in spec.tensors:
            offsets.append(end)
            end = _aligned(end + entry.nbytes)
        return cls(spec, _aligned(header_bytes), tuple(offsets), max(end, ALIGNMENT))

    def pack(
        self, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], buffer: torch.Tensor
    ) -> None:
        """Copy ``tensors`` into their places in the uint8 ``buffer`` (any device).

        ``tensors`` is a mapping by spec name, or a sequence in spec order; each is
        contiguous, of its spec dtype or already a uint8 view of its bytes.
        """
        sources = (
            [tensors[entry.name] for entry in self.spec.tensors]
            if isinstance(tensors, Mapping)
            else tensors
        )
        for source, offset, entry in zip(sources, self.offsets, self.spec.tensors, strict=True):
            flat = source.reshape(-1)
            if flat.dtype != torch.uint8:
                flat = flat.view(torch.uint8)
            buffer[offset : offset + entry.nbytes].copy_(flat)

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
        copy: Callable[[torch.Tensor, torch.Tensor], None] = torch.Tensor.copy_,
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
        """One tensor per spec entry, in spec order, viewing the uint8 ``buffer`` (no copy)."""
        return [
            buffer[offset : offset + entry.nbytes].view(entry.dtype).view(entry.shape)
            for offset, entry in zip(self.offsets, self.spec.tensors, strict=True)
        ]

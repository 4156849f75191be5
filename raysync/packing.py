"""One flat byte buffer for a whole version: where each tensor of a spec lives in it.

Transports that move a version as *one* message (a collective broadcast, one RPC) pack
every tensor of the spec into a single uint8 buffer, in spec order, each starting on a
64-byte boundary after a fixed-size header. Both sides compute the same
:class:`PackedLayout` from the spec, so only the buffer travels; the receiver's
tensors are views of the buffer it received (no copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from raysync.spec import WeightSpec

#: Every tensor (and the payload after the header) starts on a multiple of this.
ALIGNMENT = 64


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class PackedLayout:
    """Byte offsets of a spec's tensors in a packed buffer of ``nbytes`` bytes."""

    spec: WeightSpec
    header_bytes: int
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, spec: WeightSpec, header_bytes: int = 0) -> PackedLayout:
        """The layout of ``spec`` after a header of ``header_bytes`` (rounded up to 64)."""
        offsets = []
        cursor = _align(header_bytes)
        for entry in spec.tensors:
            offsets.append(cursor)
            cursor = _align(cursor + entry.nbytes)
        return cls(spec, _align(header_bytes), tuple(offsets), max(cursor, ALIGNMENT))

    def pack(self, sources: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        """Copy ``sources`` (contiguous tensors or uint8 byte views, in spec order) into
        ``buffer`` (uint8, at least ``nbytes`` long, any device)."""
        for source, offset, entry in zip(sources, self.offsets, self.spec.tensors, strict=True):
            flat = source.reshape(-1)
            if flat.dtype != torch.uint8:
                flat = flat.view(torch.uint8)
            buffer[offset : offset + entry.nbytes].copy_(flat)

    def unpack(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``buffer`` (uint8), one per spec entry with its dtype and shape."""
        return [
            buffer[offset : offset + entry.nbytes].view(entry.dtype).view(entry.shape)
            for offset, entry in zip(self.offsets, self.spec.tensors, strict=True)
        ]

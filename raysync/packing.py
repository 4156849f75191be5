"""Packed layout: one version's tensors back to back in a single uint8 buffer.

A buffer starts with a :data:`HEADER_BYTES` header that a transport may use (the
shared-memory transport keeps its segment token and the version's sequence number
there); each tensor follows at a 64-byte aligned offset, in spec order. The layout is a
pure function of the spec, so both sides compute it and only the spec travels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from raysync.spec import WeightSpec

#: Alignment of every tensor in a packed buffer (a cache line; enough for any dtype).
ALIGNMENT = 64
#: Bytes reserved at the start of a packed buffer for the transport's own header.
HEADER_BYTES = 64


def _aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class Layout:
    """Byte offset of each tensor of a spec in a packed buffer of ``nbytes`` bytes."""

    spec: WeightSpec
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, spec: WeightSpec) -> Layout:
        offsets, end = [], HEADER_BYTES
        for entry in spec.tensors:
            offsets.append(end)
            end = _aligned(end + entry.nbytes)
        return cls(spec, tuple(offsets), end)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of a uint8 ``buffer`` of at least ``nbytes``, in spec order."""
        return [
            buffer[offset : offset + entry.nbytes].view(entry.dtype).view(entry.shape)
            for offset, entry in zip(self.offsets, self.spec.tensors, strict=True)
        ]

    def pack(self, tensors: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> None:
        """Copy ``tensors`` (by spec name; any device) into their places in ``buffer``."""
        destinations: Sequence[torch.Tensor] = self.views(buffer)
        for entry, destination in zip(self.spec.tensors, destinations, strict=True):
            destination.copy_(tensors[entry.name])

"""PackedLayout: where each tensor of a spec lives in one contiguous byte buffer.

Transports that move a model as one block of registered memory (NIXL) pack the
learner's tensors into such a buffer and hand receivers views of their own copy. Both
sides compute the layout from the spec alone, so only the spec travels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from raysync.spec import WeightSpec

#: Every tensor starts at a multiple of this many bytes (a cache line; any dtype's itemsize).
ALIGNMENT = 64


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class PackedLayout:
    """Byte offsets of a spec's tensors, in spec order, in one buffer of ``nbytes``."""

    spec: WeightSpec
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, spec: WeightSpec) -> PackedLayout:
        offsets, end = [], 0
        for entry in spec.tensors:
            offsets.append(end)
            end = _aligned(end + entry.nbytes)
        return cls(spec, tuple(offsets), end)

    def pack(self, tensors: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> None:
        """Copy ``tensors`` (contiguous, any device) into the uint8 ``buffer`` at their offsets."""
        for entry, offset in zip(self.spec.tensors, self.offsets, strict=True):
            source = tensors[entry.name].reshape(-1).view(torch.uint8)
            buffer[offset : offset + entry.nbytes].copy_(source)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """One tensor per spec entry, in spec order, viewing the uint8 ``buffer`` (no copy)."""
        return [
            buffer[offset : offset + entry.nbytes].view(entry.dtype).view(entry.shape)
            for entry, offset in zip(self.spec.tensors, self.offsets, strict=True)
        ]

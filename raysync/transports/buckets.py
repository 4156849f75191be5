"""Buckets: one version's bytes cut into fixed-size pieces that move one after another.

A bucketed version is its :class:`~raysync.layout.PackedLayout` (no header) cut into
buckets of ``bucket_bytes``: bucket ``k`` is the layout's bytes ``[k * bucket_bytes,
(k + 1) * bucket_bytes)``. A tensor larger than a bucket spans several; a bucket may
hold the end of one tensor and the start of the next. The cut is a pure function of
the spec and the bucket size, so the learner (which packs the pieces) and each receiver
(which copies them into its staging buffer) compute it alike and only the size travels.

Bucket sizes are whole multiples of the layout's 64-byte alignment, so every cut
inside a tensor falls on an element boundary of any dtype: a piece of a floating
tensor can be cast to the wire dtype on its own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from raysync.layout import ALIGNMENT, PackedLayout
from raysync.spec import WeightSpec

#: Bytes in a mebibyte, the unit of ``bucket_mb``.
MIB = 1 << 20


def bucket_bytes_of(bucket_mb: float) -> int:
    """``bucket_mb`` (mebibytes, fractions allowed) as bytes, rounded up to the layout's
    alignment; ValueError unless positive."""
    if (
        isinstance(bucket_mb, bool)
        or not isinstance(bucket_mb, (int, float))
        or not 0 < bucket_mb < math.inf
    ):
        raise ValueError(f"bucket_mb must be a positive number of MiB, got {bucket_mb!r}")
    size = int(-(-bucket_mb * MIB // 1))
    return max(ALIGNMENT, -(-size // ALIGNMENT) * ALIGNMENT)


@dataclass(frozen=True)
class Piece:
    """The bytes ``[start, end)`` of tensor ``tensor`` (spec order), which sit at
    ``at`` in the packed layout (a receiver's staging buffer)."""

    tensor: int
    start: int
    end: int
    at: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BucketPlan:
    """How the version of ``spec`` is cut into buckets of ``bucket_bytes``."""

    spec: WeightSpec
    bucket_bytes: int

    @classmethod
    def of(cls, spec: WeightSpec, bucket_bytes: int) -> BucketPlan:
        if bucket_bytes <= 0 or bucket_bytes % ALIGNMENT:
            raise ValueError(
                f"bucket_bytes must be a positive multiple of {ALIGNMENT}, got {bucket_bytes}"
            )
        return cls(spec, bucket_bytes)

    @property
    def layout(self) -> PackedLayout:
        return PackedLayout.of(self.spec)

    @property
    def count(self) -> int:
        """How many buckets the version takes (0 for a version with no bytes)."""
        return len(self._pieces)

    def pieces(self, index: int) -> tuple[Piece, ...]:
        """The pieces of bucket ``index``, in layout order."""
        return self._pieces[index]

    @functools.cached_property
    def _pieces(self) -> tuple[tuple[Piece, ...], ...]:
        layout, size = self.layout, self.bucket_bytes
        buckets: list[list[Piece]] = []
        for index, (offset, entry) in enumerate(
            zip(layout.offsets, self.spec.tensors, strict=True)
        ):
            start = 0
            while start < entry.nbytes:
                at = offset + start
                bucket = at // size
                end = min(entry.nbytes, (bucket + 1) * size - offset)
                while len(buckets) <= bucket:
                    buckets.append([])
                buckets[bucket].append(Piece(index, start, end, at))
                start = end
        return tuple(tuple(bucket) for bucket in buckets)


def pack_bucket(
    data: torch.Tensor,
    plan: BucketPlan,
    sources: Sequence[torch.Tensor],
    index: int,
    copy: Callable[[torch.Tensor, torch.Tensor], object] = torch.Tensor.copy_,
) -> None:
    """Learner: bucket ``index`` of ``plan`` from ``sources`` (the learner's tensors, in
    spec order) into ``data`` (uint8, at least the bucket's bytes), each piece at its
    place in the bucket, cast to the wire dtype while copied where its source has
    another dtype (no piece-sized copy, but from another device: the cast is made
    where the source lives, as a version sent whole is, and the copy moves its bytes;
    across devices torch's ``copy_`` casts on the CPU, and CUDA and the CPU write a NaN
    in bfloat16 differently); ``copy`` copies bytes of one dtype."""
    base = index * plan.bucket_bytes
    for piece in plan.pieces(index):
        wire = plan.spec.tensors[piece.tensor].dtype
        flat = sources[piece.tensor].reshape(-1)
        chunk = flat[piece.start // wire.itemsize : piece.end // wire.itemsize]
        target = data[piece.at - base : piece.at - base + piece.nbytes]
        if chunk.dtype == wire:
            copy(target, chunk.view(torch.uint8))
        elif chunk.device != target.device:
            target.view(wire).copy_(chunk.to(wire))
        else:
            target.view(wire).copy_(chunk)

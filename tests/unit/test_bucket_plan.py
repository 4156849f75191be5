"""BucketPlan (raysync/transports/buckets.py): how a version is cut into buckets, and
the learner's pieces copied into a receiver's staging buffer in bucket order rebuild the
version bit for bit, wire-dtype casts included."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from raysync.copies import copy_on_this_thread
from raysync.layout import ALIGNMENT, PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.buckets import BucketPlan, bucket_bytes_of, pack_bucket
from raysync.transports.object_store.buckets import Outgoing, bucket_arrays
from raysync.wire_dtype import wire_spec_of


def _model(seed: int) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for index in range(rng.randint(1, 12)):
        shape = tuple(rng.randint(0, 40) for _ in range(rng.randint(0, 3)))
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
        if dtype.is_floating_point:
            tensors[f"t{index:02d}"] = torch.randn(shape, generator=generator).to(dtype)
        else:
            tensors[f"t{index:02d}"] = torch.randint(0, 2, shape, generator=generator).to(dtype)
    return tensors


def _through_buckets(
    tensors: dict[str, torch.Tensor], wire: WeightSpec, bucket_bytes: int
) -> list[torch.Tensor]:
    """What a receiver stages: each bucket's pieces copied to their place, in order."""
    plan = BucketPlan.of(wire, bucket_bytes)
    outgoing = Outgoing([tensors[name] for name in wire.names], plan)
    buffer = torch.zeros(plan.layout.nbytes, dtype=torch.uint8)
    for index in range(plan.count):
        arrays = bucket_arrays(outgoing, index)
        assert sum(a.nbytes for a in arrays) <= bucket_bytes
        for piece, array in zip(plan.pieces(index), arrays, strict=True):
            buffer[piece.at : piece.at + piece.nbytes].copy_(torch.from_numpy(array))
    return plan.layout.views(buffer)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("bucket_bytes", [64, 128, 960, 4096])
def test_pieces_cover_every_byte_once_and_rebuild_the_version(seed, bucket_bytes):
    tensors = _model(seed)
    spec = WeightSpec.of(tensors)
    plan = BucketPlan.of(spec, bucket_bytes)
    covered = {name: 0 for name in spec.names}
    for index in range(plan.count):
        pieces = plan.pieces(index)
        assert pieces, f"bucket {index} is empty"
        for piece in pieces:
            assert index * bucket_bytes <= piece.at < (index + 1) * bucket_bytes
            assert piece.at + piece.nbytes <= (index + 1) * bucket_bytes
            name = spec.names[piece.tensor]
            assert piece.start == covered[name], "pieces of a tensor follow each other"
            covered[name] = piece.end
    assert covered == {t.name: t.nbytes for t in spec.tensors}
    staged = _through_buckets(tensors, spec, bucket_bytes)
    for name, view in zip(spec.names, staged, strict=True):
        assert torch.equal(
            view.reshape(-1).view(torch.uint8), tensors[name].reshape(-1).view(torch.uint8)
        )


@pytest.mark.parametrize("seed", range(10))
def test_pieces_cast_to_the_wire_dtype_equal_the_whole_cast(seed):
    tensors = {n: t for n, t in _model(seed).items() if t.dtype != torch.float16}
    spec = WeightSpec.of(tensors)
    wire = wire_spec_of(spec, torch.bfloat16) or spec
    staged = _through_buckets(tensors, wire, 128)
    for name, view in zip(wire.names, staged, strict=True):
        source = tensors[name]
        expected = source.to(torch.bfloat16) if source.dtype.is_floating_point else source
        assert view.dtype == expected.dtype
        assert torch.equal(
            view.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)
        )


def test_a_tensor_larger_than_a_bucket_spans_several():
    spec = WeightSpec.of({"big": torch.zeros(1000), "small": torch.zeros(3)})
    plan = BucketPlan.of(spec, 1024)
    assert plan.count == 4  # 4000 bytes, then "small" at 4032
    assert [len(plan.pieces(i)) for i in range(plan.count)] == [1, 1, 1, 2]
    assert plan.pieces(3)[1].at == PackedLayout.of(spec).offsets[1]


def test_a_model_without_bytes_takes_no_bucket():
    assert BucketPlan.of(WeightSpec.of({"empty": torch.zeros(0, 4)}), 64).count == 0


def test_bucket_sizes_round_up_to_the_alignment_and_refuse_nonsense():
    assert bucket_bytes_of(1) == 1 << 20
    assert bucket_bytes_of(1 / 1024) == 1024
    assert bucket_bytes_of(1e-9) == ALIGNMENT
    assert bucket_bytes_of(100 / (1 << 20)) == 128
    for bad in (0, -1, float("nan"), float("inf"), "8", True):
        with pytest.raises(ValueError, match="bucket_mb must be a positive number of MiB"):
            bucket_bytes_of(bad)
    with pytest.raises(ValueError, match="positive multiple of 64"):
        BucketPlan.of(WeightSpec.of({"w": torch.zeros(3)}), 100)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("bucket_bytes", [64, 960])
def test_a_packed_bucket_is_the_wire_layouts_bytes_at_its_place(seed, bucket_bytes):
    """``pack_bucket`` (the NIXL and RDT rings): bucket k, READ to ``k * bucket_bytes`` of
    a receiver's staging buffer, rebuilds the version cast to the wire dtype."""
    tensors = {n: t for n, t in _model(seed).items() if t.dtype != torch.float16}
    wire = wire_spec_of(WeightSpec.of(tensors), torch.bfloat16) or WeightSpec.of(tensors)
    plan = BucketPlan.of(wire, bucket_bytes)
    sources = [tensors[name] for name in wire.names]
    staging = torch.zeros(plan.layout.nbytes, dtype=torch.uint8)
    for index in range(plan.count):
        slot = torch.full((bucket_bytes,), 0xAB, dtype=torch.uint8)  # last user's bytes
        pack_bucket(slot, plan, sources, index, copy_on_this_thread)
        start = index * bucket_bytes
        length = min(bucket_bytes, plan.layout.nbytes - start)
        staging[start : start + length] = slot[:length]
    for name, view in zip(wire.names, plan.layout.views(staging), strict=True):
        source = tensors[name]
        expected = source.to(torch.bfloat16) if source.dtype.is_floating_point else source
        assert torch.equal(
            view.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)
        )


def test_a_non_contiguous_tensor_is_flattened_once_for_all_its_buckets(monkeypatch):
    """A receiver serving a late joiner sends its model's own tensors, which may be
    views (a transposed weight, channels_last): each bucket flattened the whole tensor
    again, k copies of it for a tensor over k buckets (a 16 MB one in 256 KiB buckets:
    0.45 s against 1 ms). The bytes are those of the contiguous tensor."""
    weight = torch.randn(64, 48).t()  # 12 KiB, not contiguous
    assert not weight.is_contiguous()
    spec = WeightSpec.of({"w": weight})
    plan = BucketPlan.of(spec, 1024)
    assert plan.count == 12
    outgoing = Outgoing([weight], plan)
    flattened: list[int] = []
    reshape = torch.Tensor.reshape

    def counted(self, *shape):
        flattened.append(self.numel())
        return reshape(self, *shape)

    monkeypatch.setattr(torch.Tensor, "reshape", counted)
    arrays = [a for index in range(plan.count) for a in bucket_arrays(outgoing, index)]
    monkeypatch.undo()
    assert flattened == [weight.numel()]
    sent = torch.from_numpy(np.concatenate(arrays))
    assert torch.equal(sent, weight.contiguous().reshape(-1).view(torch.uint8))

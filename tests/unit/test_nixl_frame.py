"""The NIXL transport's buffer frame (raysync/transports/nixl/wire.py), without a NIXL agent.

Both sides compute a version's frame from the spec alone: one int64 stamp per bucket
of ``BUCKET_BYTES``, then the tensors packed by PackedLayout, written and read bucket by
bucket. Covered: the stamp header and bucket bounds (one bucket and several), the
descriptor list both agents prepare (the indices the receiver's READs use), a bucket by
bucket write as the learner does it (``pack_range`` with the single-thread copy, then
the bucket's stamp) equal to the whole pack, and the receiver's messages for a torn or
abandoned version. Nothing here creates an agent or imports nixl.
"""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch

from raysync.copies import copy_on_this_thread
from raysync.layout import ALIGNMENT, PackedLayout, _layout_of
from raysync.spec import TensorSpec, WeightSpec
from raysync.transports.base import TransportError
from raysync.transports.nixl import ABANDONED, BUCKET_BYTES, NixlPayload, NixlReceiver, NixlRegion
from raysync.transports.nixl.wire import Frame
from raysync.transports.nixl.wire import descs as descriptor_list

#: Elements of the large spec's float32 and bfloat16 tensors: about 2.3 buckets in all,
#: so three buckets, the last one partial, with tensors that straddle bucket bounds.
_BIG_F32 = BUCKET_BYTES // 4 + 1000
_BIG_BF16 = (BUCKET_BYTES + BUCKET_BYTES // 3) // 2


def _small() -> dict[str, torch.Tensor]:
    return {
        "a.weight": torch.randn(5, 3),
        "b.bias": torch.randn(7, dtype=torch.float64),
        "c.flag": torch.tensor([True, False]),
        "d.step": torch.tensor(11),
    }


def _big() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "layer0": torch.randn(_BIG_F32, generator=generator),
        "layer1": torch.randint(-100, 100, (3, 5), dtype=torch.int16, generator=generator),
        "layer2": torch.randn(_BIG_BF16, generator=generator).to(torch.bfloat16),
    }


def _big_spec() -> WeightSpec:
    """The spec of :func:`_big` without making its 16 MB of data."""
    return WeightSpec(
        (
            TensorSpec.of("layer0", (_BIG_F32,), torch.float32),
            TensorSpec.of("layer1", (3, 5), torch.int16),
            TensorSpec.of("layer2", (_BIG_BF16,), torch.bfloat16),
        )
    )


def _write_like_the_learner(frame: Frame, tensors: dict[str, torch.Tensor], stamp: int):
    """What NixlSender.send and .submitted do to a CPU buffer, minus the agent."""
    buffer = torch.full((frame.layout.nbytes,), 0xA5, dtype=torch.uint8)
    stamps = frame.stamps(buffer)
    stamps.zero_()
    sources = frame.layout.byte_views(tensors)
    written = []
    for index, (start, end) in enumerate(frame.buckets):
        frame.layout.pack_range(sources, buffer, start, end, copy=copy_on_this_thread)
        stamps[index] = stamp
        written.append(stamps.tolist())
    return buffer, written


def test_a_small_spec_takes_one_bucket_after_a_one_stamp_header():
    spec = WeightSpec.of(_small())
    frame = Frame.of(spec)
    assert frame.layout.header_bytes == ALIGNMENT  # 8 bytes of stamp, rounded up
    assert frame.layout.nbytes == ALIGNMENT + PackedLayout.of(spec).nbytes
    assert frame.buckets == ((ALIGNMENT, frame.layout.nbytes),)
    assert frame.layout.offsets == tuple(
        offset + ALIGNMENT for offset in PackedLayout.of(spec).offsets
    )


def test_a_large_spec_is_cut_into_full_buckets_and_a_last_shorter_one():
    spec = _big_spec()
    assert spec == WeightSpec.of(_big())
    frame = Frame.of(spec)
    data_bytes = PackedLayout.of(spec).nbytes
    assert data_bytes > 2 * BUCKET_BYTES
    assert len(frame.buckets) == 3
    start = frame.layout.header_bytes
    assert start == ALIGNMENT  # three stamps: 24 bytes
    assert frame.buckets == (
        (start, start + BUCKET_BYTES),
        (start + BUCKET_BYTES, start + 2 * BUCKET_BYTES),
        (start + 2 * BUCKET_BYTES, frame.layout.nbytes),
    )
    assert frame.layout.nbytes - frame.layout.header_bytes == data_bytes
    assert 0 < frame.buckets[-1][1] - frame.buckets[-1][0] < BUCKET_BYTES


def test_more_than_eight_buckets_need_a_longer_header():
    # 9 buckets' worth of bytes, described by the spec alone (no tensor is allocated).
    spec = WeightSpec((TensorSpec.of("huge", (8 * BUCKET_BYTES + 1,), torch.uint8),))
    frame = Frame.of(spec)
    assert len(frame.buckets) == 9
    assert frame.layout.header_bytes == 2 * ALIGNMENT  # 72 bytes of stamps, rounded up
    assert frame.buckets[0][0] == frame.layout.offsets[0] == 2 * ALIGNMENT
    assert frame.buckets[-1] == (
        2 * ALIGNMENT + 8 * BUCKET_BYTES,
        frame.layout.nbytes,
    )
    for (_, end), (start, _) in itertools.pairwise(frame.buckets):
        assert end == start


def test_both_sides_compute_the_same_frame_from_equal_specs():
    """The receiver gets the spec pickled and computes its frame itself. Specs, layouts
    and frames are cached per process, so both caches are emptied first: otherwise the
    receiver's frame would be the sender's object, equal to itself whatever it holds."""
    sender_spec = WeightSpec.of(_big())
    sender = Frame.of(sender_spec)
    receiver_spec = pickle.loads(pickle.dumps(sender_spec))
    Frame.of.cache_clear()
    _layout_of.cache_clear()
    receiver = Frame.of(receiver_spec)
    assert receiver_spec is not sender_spec
    assert receiver is not sender and receiver.layout is not sender.layout
    assert receiver == sender


def test_the_stamps_are_an_int64_view_of_the_buffers_head():
    frame = Frame.of(_big_spec())
    buffer = torch.zeros(frame.layout.nbytes, dtype=torch.uint8)
    stamps = frame.stamps(buffer)
    assert stamps.dtype == torch.int64 and stamps.shape == (3,)
    stamps[1] = 0x0102030405060708
    stamps[2] = ABANDONED
    assert buffer[8:16].tolist() == [8, 7, 6, 5, 4, 3, 2, 1]  # little endian, in place
    assert buffer[16:24].tolist() == [0xFF] * 8
    assert buffer[:8].tolist() == [0] * 8 and not buffer[24:].any()


@pytest.mark.parametrize("tensors", [_small, _big], ids=["one-bucket", "three-buckets"])
def test_a_bucket_by_bucket_write_equals_the_whole_pack_and_stamps_each_bucket(tensors):
    tensors = tensors()
    frame = Frame.of(WeightSpec.of(tensors))
    stamp = 41
    buffer, stamps_after_each = _write_like_the_learner(frame, tensors, stamp)
    count = len(frame.buckets)
    # Bucket k is stamped once it is written, not before.
    assert stamps_after_each == [[stamp] * (k + 1) + [0] * (count - k - 1) for k in range(count)]
    whole = torch.full((frame.layout.nbytes,), 0xA5, dtype=torch.uint8)
    frame.layout.pack(tensors, whole)
    frame.stamps(whole).fill_(stamp)
    assert torch.equal(buffer, whole)
    names = WeightSpec.of(tensors).names
    for name, view in zip(names, frame.layout.views(buffer), strict=True):
        assert view.dtype == tensors[name].dtype
        assert torch.equal(view, tensors[name]), name


def test_the_single_thread_copy_moves_bytes_like_copy():
    source = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    destination = torch.zeros(1200, dtype=torch.uint8)
    copy_on_this_thread(destination[100:1100], source)
    assert torch.equal(destination[100:1100], source)
    assert destination[:100].sum().item() == 0 and destination[1100:].sum().item() == 0


def test_the_descriptor_list_is_all_stamps_then_each_bucket():
    frame = Frame.of(_big_spec())
    address, device = 0x7F0000001000, 3
    descs = descriptor_list(address, device, frame)
    count = len(frame.buckets)
    assert len(descs) == 1 + count
    # The receiver prepares READs by index: 0 all stamps, 1 + k bucket k's data (and
    # 1 .. count together: all the data in one request).
    assert descs[0] == (address, 8 * count, device)
    for k, (start, end) in enumerate(frame.buckets):
        assert descs[1 + k] == (address + start, end - start, device)
    # Together the buckets cover every byte after the header exactly once.
    covered = sum(size for _, size, _ in descs[1 : 1 + count])
    assert covered == frame.layout.nbytes - frame.layout.header_bytes


def _payload(stamp: int) -> NixlPayload:
    region = NixlRegion(address=0x1000, nbytes=4096, device_id=0, mem_type="DRAM")
    return NixlPayload("raysync-learner-abc", b"meta", 1, region, stamp)


def test_a_read_that_finds_another_stamp_reports_an_overwritten_version():
    error = NixlReceiver._not_that_version(_payload(7), 9)
    assert isinstance(error, TransportError)
    assert str(error) == (
        "the learner (agent raysync-learner-abc) overwrote its buffer while this receiver "
        "read it (stamp 9, expected 7): two newer versions were broadcast during the read; "
        "this version is dropped"
    )


def test_a_read_that_finds_the_abandoned_stamp_reports_a_failed_learner():
    error = NixlReceiver._not_that_version(_payload(7), ABANDONED)
    assert isinstance(error, TransportError)
    assert str(error) == (
        "the learner (agent raysync-learner-abc) failed while writing stamp 7; "
        "this version is dropped"
    )


def test_a_closed_receiver_reads_nothing_more():
    """The core registered again and closed this receiver while a delivery was on its
    way to it: its fetch must not register new staging, never to be let go."""
    receiver = NixlReceiver("w")
    receiver.close()
    spec = WeightSpec.of(_small())
    with pytest.raises(TransportError, match="closed"):
        receiver.fetch(_payload(7), spec)
    assert receiver._pool.close() == []  # no staging was made

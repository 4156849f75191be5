"""A process's mappings of shared-memory segments (raysync/transports/shared_memory/
segments.py): typed views of a segment are made once per layout and always show what
the segment holds now; another layout, or another owner, gets views of its own."""

from __future__ import annotations

import mmap
import os
import secrets

import pytest
import torch

from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.shared_memory import HEADER_BYTES, TOKEN_BYTES, Slot
from raysync.transports.shared_memory.segments import Mappings


@pytest.fixture
def segment():
    """A segment as an owner makes one (a memfd with its token), in this process."""
    nbytes = 1 << 16
    token = secrets.token_bytes(TOKEN_BYTES)
    fd = os.memfd_create("raysync-test-segment", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    writer = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
    writer[:TOKEN_BYTES] = torch.frombuffer(bytearray(token), dtype=torch.uint8)
    slot = Slot(node_id="n", pid=os.getpid(), fd=fd, token=token, nbytes=nbytes, seq=1)
    yield slot, writer
    os.close(fd)


def _layout(**shapes: tuple[int, ...]) -> PackedLayout:
    spec = WeightSpec.of({name: torch.zeros(shape) for name, shape in shapes.items()})
    return PackedLayout.of(spec, HEADER_BYTES)


def test_views_of_a_segment_show_each_version_written_into_it(segment):
    slot, writer = segment
    layout = _layout(a=(3, 4), b=(5,))
    reader = Mappings(writable=False)
    for version in (1.0, 2.0):
        layout.pack({"a": torch.full((3, 4), version), "b": torch.arange(5.0) + version}, writer)
        a, b = reader.views(slot, layout)
        assert torch.equal(a, torch.full((3, 4), version))
        assert torch.equal(b, torch.arange(5.0) + version)
    # Made once: the second version's views are the first's.
    assert [v.data_ptr() for v in reader.views(slot, layout)] == [a.data_ptr(), b.data_ptr()]


def test_another_layout_of_the_same_segment_gets_its_own_views(segment):
    slot, writer = segment
    reader = Mappings(writable=False)
    first = _layout(a=(3, 4), b=(5,))
    second = _layout(a=(2, 2), c=(7,))
    assert [v.shape for v in reader.views(slot, first)] == [(3, 4), (5,)]
    second.pack({"a": torch.ones(2, 2), "c": torch.arange(7.0)}, writer)
    a, c = reader.views(slot, second)
    assert a.shape == (2, 2) and c.shape == (7,)
    assert torch.equal(c, torch.arange(7.0))


def test_a_writers_views_are_the_packs_destinations(segment):
    slot, _ = segment
    layout = _layout(a=(3, 4), b=(5,))
    writer = Mappings(writable=True)
    buffer = writer.buffer(slot)
    layout.pack(
        {"a": torch.full((3, 4), 7.0), "b": torch.ones(5)}, buffer, writer.views(slot, layout)
    )
    assert torch.equal(layout.views(buffer)[0], torch.full((3, 4), 7.0))


def test_a_segment_its_owner_freed_is_let_go_when_another_is_mapped(segment):
    from raysync.transports.shared_memory.wire import RETIRED_SEQ, write_seq

    slot, writer = segment
    mappings = Mappings(writable=False)
    first = mappings.buffer(slot)
    write_seq(writer.numpy(), RETIRED_SEQ)  # the owner freed it
    token = secrets.token_bytes(TOKEN_BYTES)
    fd = os.memfd_create("raysync-test-segment", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, slot.nbytes)
        os.pwrite(fd, token, 0)
        other = Slot(node_id="n", pid=os.getpid(), fd=fd, token=token, nbytes=slot.nbytes, seq=2)
        mappings.buffer(other)
        assert mappings.buffer(slot) is not first  # mapped anew: the old mapping was let go
    finally:
        os.close(fd)

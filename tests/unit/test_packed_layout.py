"""PackedLayout (raysync/layout.py): exact offsets, bit patterns and piecewise packing.

Complements tests/test_layout.py (the pack/views round trip of a fixed set of tensors):
the exact offsets and sizes the 64-byte alignment gives, round trips that compare bit
patterns (NaN payloads, -0.0, subnormals in bfloat16/float16/float32, complex, bool,
empty and 0-d tensors) through integer views, views that alias the buffer, padding left
untouched, ``byte_views``, and ``pack_range``: any split of the buffer into byte ranges,
packed in any order, equals the whole pack byte for byte and touches nothing outside
its range.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from raysync.layout import ALIGNMENT, HEADER_BYTES, PackedLayout
from raysync.spec import TensorSpec, WeightSpec

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal on NaN is False, and -0.0 equals 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _special(dtype: torch.dtype) -> torch.Tensor:
    """Values whose bits a float round trip could change: NaN with payloads, -0.0, inf,
    subnormals, the largest finite value."""
    info = torch.finfo(dtype)
    values = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), info.max, -info.max, info.tiny, 1.0], dtype=dtype
    )
    bits = values.view(_BITS[dtype])
    nan_payloads = {
        torch.bfloat16: [0x7FC1, 0x7F81, -0x3F],  # quiet and signalling NaNs, negative NaN
        torch.float16: [0x7E01, 0x7C01, -0x1FF],
        torch.float32: [0x7FC00001, 0x7F800001, -0x3FFFFF],
    }[dtype]
    subnormal = [1, 3]  # the smallest subnormals
    extra = torch.tensor(nan_payloads + subnormal, dtype=_BITS[dtype])
    return torch.cat([bits, extra]).view(dtype)


def _mixed() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {
        "a.bf16": _special(torch.bfloat16),
        "b.f16": _special(torch.float16).reshape(13, 1),
        "c.f32": _special(torch.float32),
        "d.c64": torch.randn(3, dtype=torch.complex64, generator=generator),
        "e.bool": torch.tensor([[True, False, True], [False, False, True]]),
        "f.empty": torch.zeros(0, 7, dtype=torch.float64),
        "g.scalar.bf16": torch.tensor(-0.0, dtype=torch.bfloat16),
        "h.scalar.i64": torch.tensor(-(2**62) - 5),
        "i.u8": torch.arange(255, 0, -3, dtype=torch.uint8),
        "j.i16": torch.tensor([-(2**15), 2**15 - 1, 0], dtype=torch.int16),
        "k.f64": torch.randn(2, 3, 5, dtype=torch.float64, generator=generator),
    }


def _spec(*entries: tuple[str, tuple[int, ...], torch.dtype]) -> WeightSpec:
    return WeightSpec(tuple(TensorSpec.of(name, shape, dtype) for name, shape, dtype in entries))


def test_offsets_and_size_follow_the_64_byte_alignment_exactly():
    spec = _spec(
        ("a", (3,), torch.uint8),  # 3 bytes
        ("b", (16,), torch.float32),  # 64 bytes
        ("c", (65,), torch.uint8),  # 65 bytes
        ("d", (0,), torch.float64),  # 0 bytes
        ("e", (), torch.float64),  # 8 bytes
    )
    layout = PackedLayout.of(spec)
    assert layout.header_bytes == 0
    assert layout.offsets == (0, 64, 128, 256, 256)
    assert layout.nbytes == 320
    with_header = PackedLayout.of(spec, header_bytes=1)
    assert with_header.header_bytes == 64
    assert with_header.offsets == (64, 128, 192, 320, 320)
    assert with_header.nbytes == 384
    assert PackedLayout.of(spec, HEADER_BYTES + 1).offsets[0] == 128


def test_a_spec_without_bytes_still_gets_one_aligned_block():
    assert PackedLayout.of(_spec()).nbytes == ALIGNMENT
    empty = PackedLayout.of(_spec(("e", (0, 3), torch.float32)))
    assert (empty.offsets, empty.nbytes) == ((0,), ALIGNMENT)
    headed = PackedLayout.of(_spec(), header_bytes=100)
    assert (headed.header_bytes, headed.nbytes) == (128, 128)


def test_pack_then_views_keep_every_bit_of_special_values():
    tensors = _mixed()
    spec = WeightSpec.of(tensors)
    layout = PackedLayout.of(spec, HEADER_BYTES)
    buffer = torch.full((layout.nbytes,), 0x5A, dtype=torch.uint8)
    layout.pack(tensors, buffer)
    for name, view in zip(spec.names, layout.views(buffer), strict=True):
        assert _same_bits(view, tensors[name]), name
    # NaN payloads and -0.0 made it through (a float compare would not see a difference).
    a = layout.views(buffer)[spec.names.index("a.bf16")]
    assert a.view(torch.int16).tolist() == tensors["a.bf16"].view(torch.int16).tolist()
    scalar = layout.views(buffer)[spec.names.index("g.scalar.bf16")]
    assert scalar.shape == () and scalar.view(torch.int16).item() == -0x8000


def test_views_alias_the_buffer_and_padding_is_left_alone():
    tensors = _mixed()
    spec = WeightSpec.of(tensors)
    layout = PackedLayout.of(spec, HEADER_BYTES)
    buffer = torch.full((layout.nbytes,), 0xEE, dtype=torch.uint8)
    layout.pack(tensors, buffer)
    written = torch.zeros(layout.nbytes, dtype=torch.bool)
    for offset, entry in zip(layout.offsets, spec.tensors, strict=True):
        written[offset : offset + entry.nbytes] = True
    assert (buffer[~written] == 0xEE).all()  # header, gaps and tail
    views = layout.views(buffer)
    for view, offset, entry in zip(views, layout.offsets, spec.tensors, strict=True):
        if entry.nbytes:
            assert view.data_ptr() == buffer.data_ptr() + offset, entry.name
    k = views[spec.names.index("k.f64")]
    k[1, 2, 4] = 123.25
    assert layout.views(buffer)[spec.names.index("k.f64")][1, 2, 4].item() == 123.25


def test_byte_views_are_the_tensors_bytes_and_pack_takes_them_too():
    tensors = _mixed()
    spec = WeightSpec.of(tensors)
    layout = PackedLayout.of(spec)
    byte_views = layout.byte_views(tensors)
    for view, name in zip(byte_views, spec.names, strict=True):
        source = tensors[name]
        assert view.dtype == torch.uint8 and view.dim() == 1
        assert view.numel() == source.numel() * source.element_size()
        if source.numel():
            assert view.data_ptr() == source.data_ptr(), name
    from_tensors = torch.zeros(layout.nbytes, dtype=torch.uint8)
    from_bytes = torch.ones(layout.nbytes, dtype=torch.uint8)
    layout.pack(tensors, from_tensors)
    layout.pack(byte_views, from_bytes)
    for a, b in zip(layout.views(from_tensors), layout.views(from_bytes), strict=True):
        assert _same_bits(a, b)


def test_pack_refuses_a_sequence_of_the_wrong_length():
    tensors = _mixed()
    spec = WeightSpec.of(tensors)
    layout = PackedLayout.of(spec)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError):
        layout.pack([tensors[name] for name in spec.names][:-1], buffer)


def _recording(buffer: torch.Tensor, calls: list[tuple[int, int]]):
    """A ``copy`` for pack_range that records the byte range of ``buffer`` it writes."""

    def copy(destination: torch.Tensor, source: torch.Tensor) -> None:
        assert destination.numel() == source.numel() > 0
        low = destination.data_ptr() - buffer.data_ptr()
        calls.append((low, low + destination.numel()))
        destination.copy_(source)

    return copy


def _cuts(rng: random.Random, nbytes: int, pieces: int) -> list[tuple[int, int]]:
    points = sorted({0, nbytes, *(rng.randrange(1, nbytes) for _ in range(pieces - 1))})
    return list(itertools.pairwise(points))


@pytest.mark.parametrize("header_bytes", [0, HEADER_BYTES])
@pytest.mark.parametrize("seed", range(6))
def test_pack_range_over_any_split_equals_the_whole_pack(header_bytes, seed):
    rng = random.Random(seed)
    tensors = _mixed()
    spec = WeightSpec.of(tensors)
    layout = PackedLayout.of(spec, header_bytes)
    whole = torch.full((layout.nbytes,), 0x77, dtype=torch.uint8)
    layout.pack(tensors, whole)
    sources = layout.byte_views(tensors)
    ranges = _cuts(rng, layout.nbytes, rng.choice([2, 5, 17, 60]))
    if seed % 2:
        rng.shuffle(ranges)  # readers may follow a writer out of order
    pieces = torch.full((layout.nbytes,), 0x77, dtype=torch.uint8)
    for start, end in ranges:
        layout.pack_range(sources, pieces, start, end)
    assert torch.equal(pieces, whole)


def test_pack_range_byte_by_byte_equals_the_whole_pack():
    tensors = {"a": torch.arange(5, dtype=torch.int16), "b": torch.tensor([1.5, -0.0])}
    spec = WeightSpec.of(tensors)
    layout = PackedLayout.of(spec, HEADER_BYTES)
    whole = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack(tensors, whole)
    pieces = torch.zeros(layout.nbytes, dtype=torch.uint8)
    sources = layout.byte_views(tensors)
    for start in range(layout.nbytes):
        layout.pack_range(sources, pieces, start, start + 1)
    assert torch.equal(pieces, whole)


def test_pack_range_copies_only_the_bytes_inside_its_range():
    tensors = _mixed()
    spec = WeightSpec.of(tensors)
    layout = PackedLayout.of(spec, HEADER_BYTES)
    sources = layout.byte_views(tensors)
    whole = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack(tensors, whole)
    rng = random.Random(7)
    for _ in range(30):
        start = rng.randrange(0, layout.nbytes)
        end = rng.randrange(start, layout.nbytes + 1)
        calls: list[tuple[int, int]] = []
        buffer = torch.full((layout.nbytes,), 0xCC, dtype=torch.uint8)

        layout.pack_range(sources, buffer, start, end, copy=_recording(buffer, calls))
        assert all(start <= low < high <= end for low, high in calls), (start, end, calls)
        inside = torch.zeros(layout.nbytes, dtype=torch.bool)
        inside[start:end] = True
        assert (buffer[~inside] == 0xCC).all()
        # Within the range, every tensor byte is the whole pack's; padding stays as it was.
        tensor_bytes = torch.zeros(layout.nbytes, dtype=torch.bool)
        for offset, entry in zip(layout.offsets, spec.tensors, strict=True):
            tensor_bytes[offset : offset + entry.nbytes] = True
        assert torch.equal(buffer[inside & tensor_bytes], whole[inside & tensor_bytes])
        assert (buffer[inside & ~tensor_bytes] == 0xCC).all()


@pytest.mark.parametrize("seed", range(4))
def test_random_specs_lay_out_aligned_disjoint_tensors_that_round_trip(seed):
    rng = random.Random(100 + seed)
    generator = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8]
    dtypes += [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
    tensors = {}
    for index in range(rng.randrange(1, 25)):
        shape = tuple(rng.choice([0, 1, 2, 3, 7, 16]) for _ in range(rng.randrange(0, 4)))
        dtype = rng.choice(dtypes)
        raw = torch.randint(
            0,
            256,
            (torch.Size(shape).numel() * dtype.itemsize,),
            dtype=torch.uint8,
            generator=generator,
        )
        if dtype is torch.bool:
            raw = raw % 2
        tensors[f"t{index:02d}"] = raw.view(dtype).reshape(shape)
    spec = WeightSpec.of(tensors)
    header = rng.choice([0, 8, HEADER_BYTES, 200])
    layout = PackedLayout.of(spec, header)
    assert layout.header_bytes >= header and layout.header_bytes % ALIGNMENT == 0
    end = layout.header_bytes
    for offset, entry in zip(layout.offsets, spec.tensors, strict=True):
        assert offset % ALIGNMENT == 0 and offset >= end, (offset, end)
        end = offset + entry.nbytes
    assert end <= layout.nbytes and layout.nbytes % ALIGNMENT == 0
    assert layout.nbytes - end < ALIGNMENT or end == layout.header_bytes == 0
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack([tensors[name] for name in spec.names], buffer)
    for name, view in zip(spec.names, layout.views(buffer), strict=True):
        assert _same_bits(view, tensors[name]), name


@pytest.mark.parametrize("start", [8, 64, 4096 + 8])
def test_pack_and_views_in_a_buffer_inside_a_larger_storage(start):
    """A buffer may begin inside its storage (a slot in a segment), at a multiple of
    the largest itemsize: views of every dtype alias exactly their bytes."""
    tensors = _mixed()
    spec = WeightSpec.of(tensors)
    layout = PackedLayout.of(spec, HEADER_BYTES)
    storage = torch.zeros(start + layout.nbytes + ALIGNMENT, dtype=torch.uint8)
    buffer = storage[start : start + layout.nbytes]
    layout.pack(tensors, buffer)
    assert not storage[:start].any() and not storage[start + layout.nbytes :].any()
    views = layout.views(buffer)
    for name, view in zip(spec.names, views, strict=True):
        assert _same_bits(view, tensors[name]), name
        assert view.is_contiguous()
    views[spec.names.index("k.f64")].fill_(2.5)
    again = layout.views(buffer)[spec.names.index("k.f64")]
    assert bool((again == 2.5).all())


def test_pack_takes_shaped_sources_and_byte_views_in_one_call():
    """Sources of their spec dtype and shape, flattened ones and uint8 byte views mix."""
    tensors = _mixed()
    spec = WeightSpec.of(tensors)
    layout = PackedLayout.of(spec)
    byte_views = layout.byte_views(tensors)
    mixed = [
        byte_views[i] if i % 3 == 0 else tensors[n].reshape(-1) if i % 3 == 1 else tensors[n]
        for i, n in enumerate(spec.names)
    ]
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack(mixed, buffer)
    for name, view in zip(spec.names, layout.views(buffer), strict=True):
        assert _same_bits(view, tensors[name]), name

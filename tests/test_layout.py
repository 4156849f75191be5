"""PackedLayout: pack then view gives back every tensor bitwise, aligned, any dtype."""

from __future__ import annotations

import pytest
import torch

from raysync.layout import ALIGNMENT, PackedLayout
from raysync.spec import WeightSpec

TENSORS = {
    "a.bf16": torch.randn(3, 5).to(torch.bfloat16),
    "b.i8": torch.arange(-7, 6, dtype=torch.int8),
    "c.f64": torch.randn(2, 2, 2, dtype=torch.float64),
    "d.bool": torch.tensor([True, False, True]),
    "e.scalar": torch.tensor(2.5),
    "f.empty": torch.zeros(0, 4),
}


@pytest.mark.parametrize("header_bytes", [0, 64, 100])
@pytest.mark.parametrize("as_mapping", [True, False], ids=["mapping", "sequence"])
def test_pack_then_views_round_trip(header_bytes, as_mapping):
    spec = WeightSpec.of(TENSORS)
    layout = PackedLayout.of(spec, header_bytes)
    assert all(offset % ALIGNMENT == 0 for offset in layout.offsets)
    assert layout.offsets[0] >= header_bytes and layout.nbytes % ALIGNMENT == 0
    buffer = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
    sources = TENSORS if as_mapping else [TENSORS[name] for name in spec.names]
    layout.pack(sources, buffer)
    for name, view in zip(spec.names, layout.views(buffer), strict=True):
        assert view.dtype == TENSORS[name].dtype and view.shape == TENSORS[name].shape
        assert torch.equal(view, TENSORS[name]), name
    assert (buffer[: layout.header_bytes] == 0xAB).all()  # the header is left alone

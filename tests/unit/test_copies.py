"""copy_all (raysync/copies.py): every tensor copied exactly, whichever thread copies it
and however (one foreach call, or one memcpy per middle-sized tensor); the plan deals
each tensor to one thread, those below DEAL_BELOW_BYTES by bytes, larger ones to the
caller."""

from __future__ import annotations

import pytest
import torch

from raysync.copies import DEAL_BELOW_BYTES, SMALL_NUMEL, SPLIT_BYTES, copy_all, copy_shares
from raysync.spec import WeightSpec


def _model(small: int, small_numel: int, large: int = 2) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(small + large)
    tensors = {
        f"s{i:04d}": torch.randn(small_numel, generator=generator).to(
            [torch.float32, torch.bfloat16, torch.float64][i % 3]
        )
        for i in range(small)
    }
    tensors.update(
        {
            f"l{i}": torch.randint(0, 9, (SMALL_NUMEL * 2,), generator=generator)
            for i in range(large)
        }
    )
    return tensors


def test_one_thread_or_few_small_bytes_is_one_foreach_call():
    spec = WeightSpec.of(_model(small=400, small_numel=4096))
    assert copy_shares(spec, 1) is None
    few = WeightSpec.of(_model(small=4, small_numel=16))
    assert copy_shares(few, 4) is None


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_shares_deal_every_tensor_once_below_the_limit_evenly_by_bytes(threads):
    model = _model(small=600, small_numel=4096)
    model |= {f"x{i}": torch.empty(DEAL_BELOW_BYTES // 4, device="meta") for i in range(2)}
    spec = WeightSpec.of(model)
    shares = copy_shares(spec, threads)
    assert shares is not None and len(shares) == threads
    dealt = sorted(i for share in shares for i in share)
    assert dealt == list(range(len(spec.tensors)))
    kept = {i for i, e in enumerate(spec.tensors) if e.nbytes >= DEAL_BELOW_BYTES}
    assert len(kept) == 2 and kept <= set(shares[0])
    dealt_bytes = [sum(spec.tensors[i].nbytes for i in s if i not in kept) for s in shares]
    assert sum(dealt_bytes) >= SPLIT_BYTES
    largest = max(e.nbytes for i, e in enumerate(spec.tensors) if i not in kept)
    assert max(dealt_bytes) - min(dealt_bytes) <= 2 * largest


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_all_copies_every_tensor_bit_for_bit(threads):
    model = _model(small=600, small_numel=4096)
    spec = WeightSpec.of(model)
    sources = [model[name] for name in spec.names]
    destinations = [torch.zeros_like(t) for t in sources]
    copy_all(destinations, sources, spec, threads=threads)
    for name, d, s in zip(spec.names, destinations, sources, strict=True):
        assert torch.equal(d.view(torch.uint8), s.view(torch.uint8)), name


@pytest.mark.parametrize("bad", [0, -1], ids=["in the caller's share", "in a helper thread's"])
def test_a_failing_copy_raises(bad):
    model = _model(small=600, small_numel=4096)
    spec = WeightSpec.of(model)
    sources = [model[name] for name in spec.names]
    destinations = [torch.zeros_like(t) for t in sources]
    destinations[bad] = torch.zeros(3)  # a copy that cannot broadcast into it
    with pytest.raises(RuntimeError):
        copy_all(destinations, sources, spec, threads=2)


@pytest.mark.parametrize("threads", [1, 2])
def test_middle_sized_tensors_of_every_kind_are_copied_exactly(threads):
    """Tensors dealt and copied alone: of dtypes NumPy lacks (bfloat16), requiring grad,
    non-contiguous destinations, and pairs that cast (float32 into float64): each lands
    as ``copy_`` would land it."""
    generator = torch.Generator().manual_seed(7)
    numel = SMALL_NUMEL * 4
    sources = [
        torch.randn(numel, generator=generator).to(dtype)
        for dtype in [torch.bfloat16, torch.float32, torch.float32, torch.float16] * 8
    ]
    destinations: list[torch.Tensor] = []
    for i, source in enumerate(sources):
        if i % 4 == 0:
            destinations.append(torch.zeros_like(source))  # bfloat16 into bfloat16
        elif i % 4 == 1:
            destinations.append(torch.nn.Parameter(torch.zeros_like(source)))
        elif i % 4 == 2:
            destinations.append(torch.zeros(numel, 2, dtype=torch.float32)[:, 0])  # strided
        else:
            destinations.append(torch.zeros(numel, dtype=torch.float64))  # a cast
    spec = WeightSpec.of({f"t{i:02d}": d for i, d in enumerate(destinations)})
    expected = [torch.zeros_like(d).copy_(s) for d, s in zip(destinations, sources, strict=True)]
    assert (copy_shares(spec, threads) is None) == (threads == 1)
    copy_all(destinations, sources, spec, threads=threads)
    for i, (d, e) in enumerate(zip(destinations, expected, strict=True)):
        assert d.dtype == e.dtype and torch.equal(d.detach(), e), i

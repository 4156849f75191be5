"""copy_all (raysync/copies.py): every tensor copied exactly, whichever thread copies it;
the plan deals each tensor to one thread, small ones by bytes, large ones to the caller."""

from __future__ import annotations

import pytest
import torch

from raysync.copies import SMALL_NUMEL, SPLIT_BYTES, copy_all, copy_shares
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
def test_shares_deal_every_tensor_once_small_ones_evenly_by_bytes(threads):
    spec = WeightSpec.of(_model(small=600, small_numel=4096))
    shares = copy_shares(spec, threads)
    assert shares is not None and len(shares) == threads
    dealt = sorted(i for share in shares for i in share)
    assert dealt == list(range(len(spec.tensors)))
    large = {i for i, e in enumerate(spec.tensors) if e.numel >= SMALL_NUMEL}
    assert large and large <= set(shares[0])
    small_bytes = [sum(spec.tensors[i].nbytes for i in s if i not in large) for s in shares]
    assert sum(small_bytes) >= SPLIT_BYTES
    assert max(small_bytes) - min(small_bytes) <= 2 * max(e.nbytes for e in spec.tensors)


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

"""The staging pool nixl and rdt receivers read versions into (raysync/transports/staging.py)."""

from __future__ import annotations

import torch

from raysync.spec import WeightSpec
from raysync.transports.staging import StagingPool

SMALL = WeightSpec.of({"w": torch.zeros(4)})
LARGE = WeightSpec.of({"w": torch.zeros(64)})


def _pool() -> tuple[StagingPool[torch.Tensor], list[WeightSpec]]:
    made: list[WeightSpec] = []

    def create(spec: WeightSpec) -> torch.Tensor:
        made.append(spec)
        return torch.zeros(spec.nbytes, dtype=torch.uint8)

    return StagingPool(create), made


def test_a_leased_buffer_is_not_handed_out_again_until_released():
    pool, made = _pool()
    first = pool.take(SMALL)
    staged = [first[:4]]
    pool.lease(staged, SMALL, first)
    second = pool.take(SMALL)
    assert second is not first and made == [SMALL, SMALL]
    pool.release(staged)
    assert pool.take(SMALL) is first and len(made) == 2


def test_a_failed_fetch_puts_its_buffer_back():
    pool, made = _pool()
    buffer = pool.take(SMALL)
    pool.put_back(SMALL, buffer)
    assert pool.take(SMALL) is buffer and made == [SMALL]


def test_buffers_are_kept_per_spec():
    pool, made = _pool()
    small = pool.take(SMALL)
    pool.put_back(SMALL, small)
    large = pool.take(LARGE)
    assert large is not small and made == [SMALL, LARGE]
    assert large.numel() == 256


def test_release_of_nothing_or_of_unknown_views_is_ignored():
    pool, _ = _pool()
    buffer = pool.take(SMALL)
    pool.release(None)
    pool.release([buffer])  # never leased
    assert pool.created() == [buffer]


def test_close_returns_every_buffer_made_and_forgets_leases():
    pool, made = _pool()
    leased, free = pool.take(SMALL), pool.take(SMALL)
    staged = [leased]
    pool.lease(staged, SMALL, leased)
    pool.put_back(SMALL, free)
    assert pool.close() == [leased, free]
    assert pool.created() == []
    pool.release(staged)  # a release after close changes nothing
    assert pool.take(SMALL) is not free and len(made) == 3

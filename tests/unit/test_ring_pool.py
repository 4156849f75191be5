"""RingPool: one ring per version streaming at once, reused once given back."""

from __future__ import annotations

import torch

from raysync.transports.ring_pool import RingPool

CPU = torch.device("cpu")


def _pool() -> tuple[RingPool[list], list[tuple[int, torch.device]]]:
    made: list[tuple[int, torch.device]] = []

    def make(bucket_bytes: int, device: torch.device) -> list:
        made.append((bucket_bytes, device))
        return [bucket_bytes, len(made)]

    return RingPool(make), made


def test_a_version_streaming_after_another_reuses_its_ring():
    pool, made = _pool()
    first = pool.take(1024, CPU)
    pool.give_back(first)
    assert pool.take(1024, CPU) is first
    assert made == [(1024, CPU)]


def test_a_version_handed_off_while_another_streams_gets_a_ring_of_its_own():
    pool, made = _pool()
    first = pool.take(1024, CPU)
    second = pool.take(1024, CPU)
    assert second is not first
    assert made == [(1024, CPU), (1024, CPU)]
    pool.give_back(second)
    assert pool.take(1024, CPU) is second  # the free one, not a third
    assert list(pool) == [first, second]


def test_rings_of_another_bucket_size_are_not_shared():
    pool, made = _pool()
    small = pool.take(1024, CPU)
    pool.give_back(small)
    large = pool.take(4096, CPU)
    assert large is not small
    assert made == [(1024, CPU), (4096, CPU)]

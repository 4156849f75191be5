"""The staging pool receivers read versions into (raysync/transports/staging.py)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from raysync.copies import Viewed
from raysync.layout import PackedLayout
from raysync.spec import WeightSpec
from raysync.transports.base import TransportError
from raysync.transports.staging import SET_ASIDE_KEPT, StagingPool, StillWriting

SMALL = WeightSpec.of({"w": torch.zeros(4)})
LARGE = WeightSpec.of({"w": torch.zeros(64)})


def _pool() -> tuple[StagingPool[torch.Tensor], list[WeightSpec]]:
    made: list[WeightSpec] = []

    def create(spec: WeightSpec) -> torch.Tensor:
        made.append(spec)
        return torch.zeros(spec.nbytes, dtype=torch.uint8)

    return StagingPool(create), made


def _filled(pool: StagingPool[torch.Tensor], spec: WeightSpec) -> tuple[list, torch.Tensor]:
    """Fill a buffer of ``spec`` with ones: the leased views, and the buffer."""
    seen: list[torch.Tensor] = []

    def write(buffer: torch.Tensor) -> list[torch.Tensor]:
        seen.append(buffer)
        buffer.fill_(1)
        return [buffer[:4]]

    return pool.fill(spec, write), seen[0]


class _Broke(Exception):
    pass


def _fail(buffer: torch.Tensor) -> list[torch.Tensor]:
    buffer.fill_(2)
    raise _Broke("the read failed")


def test_a_leased_buffer_is_not_filled_again_until_released():
    pool, made = _pool()
    staged, first = _filled(pool, SMALL)
    assert torch.equal(staged[0], torch.ones(4, dtype=torch.uint8))
    _, second = _filled(pool, SMALL)
    assert second is not first and made == [SMALL, SMALL]
    pool.release(staged)
    _, third = _filled(pool, SMALL)
    assert third is first and len(made) == 2


def test_a_failed_fill_frees_its_buffer_and_raises():
    pool, made = _pool()
    with pytest.raises(_Broke, match="the read failed"):
        pool.fill(SMALL, _fail)
    _, buffer = _filled(pool, SMALL)
    assert made == [SMALL]  # the failed fill's buffer, taken again
    assert pool.created() == [buffer]


def test_a_fill_whose_transfer_may_still_run_sets_its_buffer_aside():
    """A READ that timed out may still write its buffer: the next version is read into
    another, and the one set aside is still handed back at close to deregister."""
    pool, made = _pool()
    aside: list[torch.Tensor] = []

    def timed_out(buffer: torch.Tensor) -> list[torch.Tensor]:
        aside.append(buffer)
        raise StillWriting("READ of the update did not finish within 60 s")

    with pytest.raises(StillWriting, match="did not finish"):
        pool.fill(SMALL, timed_out)
    staged, buffer = _filled(pool, SMALL)
    assert buffer is not aside[0] and made == [SMALL, SMALL]
    pool.release(staged)
    _, again = _filled(pool, SMALL)
    assert again is buffer and len(made) == 2
    assert pool.close() == [aside[0], buffer]


def test_buffers_set_aside_are_taken_back_beyond_a_few_per_spec():
    """A learner that keeps timing out (stuck, or a link slower than the READ's limit)
    cost one model-sized buffer per try, for good: beyond ``SET_ASIDE_KEPT`` of a spec,
    the oldest (its READ long over, a timeout later at least) is free again."""
    pool, made = _pool()
    aside: list[torch.Tensor] = []

    def timed_out(buffer: torch.Tensor) -> list[torch.Tensor]:
        aside.append(buffer)
        raise StillWriting("READ of the update did not finish within 60 s")

    for _ in range(SET_ASIDE_KEPT):
        with pytest.raises(StillWriting):
            pool.fill(SMALL, timed_out)
    assert len(made) == SET_ASIDE_KEPT  # each try another buffer
    with pytest.raises(StillWriting):
        pool.fill(SMALL, timed_out)
    assert len(made) == SET_ASIDE_KEPT + 1
    _, buffer = _filled(pool, SMALL)  # the oldest, taken back
    assert buffer is aside[0] and len(made) == SET_ASIDE_KEPT + 1


def test_buffers_are_kept_per_spec():
    pool, made = _pool()
    small_views, small = _filled(pool, SMALL)
    pool.release(small_views)
    _, large = _filled(pool, LARGE)
    assert large is not small and made == [SMALL, LARGE]
    assert large.numel() == 256


def test_release_of_nothing_or_of_unknown_views_is_ignored():
    pool, made = _pool()
    _, buffer = _filled(pool, SMALL)
    pool.release(None)
    pool.release([buffer])  # never leased: the buffer stays leased
    _, other = _filled(pool, SMALL)
    assert other is not buffer and len(made) == 2


def test_close_returns_every_buffer_made_and_forgets_leases():
    pool, made = _pool()
    leased_views, leased = _filled(pool, SMALL)
    free_views, free = _filled(pool, SMALL)
    pool.release(free_views)
    assert pool.close() == [leased, free]
    assert pool.created() == []
    pool.release(leased_views)  # a release after close changes nothing
    _, fresh = _filled(pool, SMALL)
    assert fresh is not free and fresh is not leased and len(made) == 3


def test_a_buffers_views_are_made_once_per_layout_and_show_what_it_holds():
    """``views`` of a pool buffer: the same views for every version written into it
    (each showing that version), new ones for another layout, none kept after close."""
    pool: StagingPool[torch.Tensor] = StagingPool(lambda spec: torch.zeros(4096, dtype=torch.uint8))
    spec_a = WeightSpec.of({"a": torch.zeros(3, 4), "b": torch.zeros(5)})
    spec_c = WeightSpec.of({"c": torch.zeros(7)})
    layout_a, layout_c = PackedLayout.of(spec_a), PackedLayout.of(spec_c)
    for value in (1.0, 2.0):

        def write(buffer: torch.Tensor, value: float = value) -> list[torch.Tensor]:
            layout_a.pack({"a": torch.full((3, 4), value), "b": torch.full((5,), value)}, buffer)
            return pool.views(buffer, layout_a)

        staged = pool.fill(spec_a, write)
        assert [t.tolist() for t in staged] == [[[value] * 4] * 3, [value] * 5]
        pool.release(staged)
    [buffer] = pool.created()
    assert pool.views(buffer, layout_a) is pool.views(buffer, layout_a)
    kept = pool.views(buffer, layout_c)
    [c] = kept
    assert c.shape == (7,) and c.data_ptr() == buffer.data_ptr()
    pool.close()
    assert pool.views(buffer, layout_c) is not kept


def test_each_fill_of_kept_views_is_leased_as_a_sequence_of_its_own_with_numpy_views():
    """A receiver copies from the NumPy views the pool keeps beside a buffer's views;
    each fill still gets a sequence of its own, which its release is known by."""
    pool: StagingPool[torch.Tensor] = StagingPool(lambda spec: torch.zeros(4096, dtype=torch.uint8))
    spec = WeightSpec.of({"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)})
    layout = PackedLayout.of(spec)

    def write(buffer: torch.Tensor) -> Sequence[torch.Tensor]:
        layout.pack(
            {"a": torch.full((3, 4), 2.0), "b": torch.full((5,), 3.0, dtype=torch.bfloat16)}, buffer
        )
        return pool.views(buffer, layout)

    first = pool.fill(spec, write)
    assert isinstance(first, Viewed) and first is not pool.views(pool.created()[0], layout)
    assert first.arrays[0].tolist() == [[2.0] * 4] * 3
    b = torch.from_numpy(first.arrays[1]).view(torch.bfloat16)
    assert torch.equal(b, torch.full((5,), 3.0, dtype=torch.bfloat16))
    second = pool.fill(spec, write)  # the first is leased: another buffer
    assert len(pool.created()) == 2 and second.arrays[0].ctypes.data != first.arrays[0].ctypes.data
    pool.release(first)
    third = pool.fill(spec, write)
    assert len(pool.created()) == 2 and third.arrays[0].ctypes.data == first.arrays[0].ctypes.data


def test_the_staging_device_is_the_one_current_where_the_process_first_asked(monkeypatch):
    """A receiver attached in a thread that set CUDA device 3 (a rollout worker's); after
    a hub restart its hub watch's thread, where the current device is 0, opened the
    transport again and staged every later version on device 0."""
    import threading

    from raysync.transports import staging

    current = threading.local()
    monkeypatch.setattr(staging.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(staging.torch.cuda, "current_device", lambda: getattr(current, "d", 0))
    staging.staging_device.cache_clear()  # as in a process that has not asked yet
    try:
        current.d = 3  # this thread set its device
        assert staging.staging_device() == torch.device("cuda", 3)
        in_watch: list[torch.device] = []
        watch = threading.Thread(target=lambda: in_watch.append(staging.staging_device()))
        watch.start()
        watch.join(30)
        assert in_watch == [torch.device("cuda", 3)]
    finally:
        staging.staging_device.cache_clear()  # the stand-in CUDA device is not kept


def test_a_nccl_member_stages_on_the_device_current_where_its_receiver_was_made(monkeypatch):
    """A threaded or async host reads each version on Ray's threads, where device 0 is
    current: a member made in a thread that set device 3 staged NCCL collectives on
    device 0 (beside its model on 3, or on another process's GPU)."""
    import threading

    from raysync.transports import staging
    from raysync.transports.distributed import group
    from raysync.transports.distributed.receiver import DistributedReceiver
    from raysync.transports.options import DistributedOptions

    current = threading.local()
    monkeypatch.setattr(staging.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(staging.torch.cuda, "current_device", lambda: getattr(current, "d", 0))
    staging.staging_device.cache_clear()  # as in a process that has not asked yet
    try:
        current.d = 3  # the host's thread, which attached, set its device
        DistributedReceiver("member").close()
        nccl = DistributedOptions(backend="nccl")
        on_a_ray_thread: list[torch.device] = []
        reading = threading.Thread(
            target=lambda: on_a_ray_thread.append(group.staging_device(nccl))
        )
        reading.start()
        reading.join(30)
        assert on_a_ray_thread == [torch.device("cuda", 3)]
        assert group.staging_device(DistributedOptions(backend="gloo")) == torch.device("cpu")
    finally:
        staging.staging_device.cache_clear()  # the stand-in CUDA device is not kept


def test_a_pool_of_buffers_to_let_go_makes_none_once_closed():
    """rdt's staging is registered memory: a delivery of a former registration still
    fetching as its receiver closed (registered again) made and registered a buffer
    after close, which nobody deregisters. One made as the pool closed is discarded."""
    discarded: list[torch.Tensor] = []
    pool: StagingPool[torch.Tensor]

    def closing_as_it_makes(spec: WeightSpec) -> torch.Tensor:
        pool.close()
        return torch.zeros(spec.nbytes, dtype=torch.uint8)

    pool = StagingPool(closing_as_it_makes, discarded.append)
    with pytest.raises(TransportError, match="this receiver closed"):
        _filled(pool, SMALL)
    assert len(discarded) == 1 and pool.close() == []
    with pytest.raises(TransportError, match="this receiver closed"):
        _filled(pool, SMALL)  # and none is made
    assert len(discarded) == 1

"""copy_all (raysync/copies.py): every tensor copied exactly, whichever thread copies it
and however (one foreach call, one memcpy per tensor, or one per range of a large one),
from tensors or from their NumPy views (:class:`Viewed`); the plan deals each tensor
below DEAL_BELOW_BYTES whole to one thread, by bytes, and cuts each larger one in one
range per thread."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from raysync.copies import (
    CUT_ALIGN,
    DEAL_BELOW_BYTES,
    SMALL_NUMEL,
    SPLIT_BYTES,
    Piece,
    Viewed,
    copy_all,
    copy_shares,
    executor,
    numpy_view,
    viewed,
)
from raysync.spec import WeightSpec
from raysync.weights import destinations

#: Elements of a float32 tensor large enough to be cut (and not a multiple of CUT_ALIGN).
_LARGE_NUMEL = DEAL_BELOW_BYTES // 4 + 1000


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


def _sides(sides: str, destinations: list[torch.Tensor], sources: list[torch.Tensor]):
    """The pair as copy_all gets it: plain tensors, or both :class:`Viewed` as a receiver
    of the object store has them (its model's views; read-only arrays it read)."""
    if sides == "tensors":
        return destinations, sources
    arrays = [numpy_view(source) for source in sources]
    for array in arrays:
        array.setflags(write=False)
    return viewed(destinations), Viewed.over(arrays, [source.dtype for source in sources])


def _whole(spec: WeightSpec) -> tuple[Piece, ...]:
    return tuple(Piece(i, 0, entry.nbytes) for i, entry in enumerate(spec.tensors))


def test_one_thread_or_few_bytes_is_one_share_of_whole_tensors():
    spec = WeightSpec.of(_model(small=400, small_numel=4096))
    assert copy_shares(spec, 1) == (_whole(spec),)
    few = WeightSpec.of(_model(small=4, small_numel=16))
    assert few.nbytes < SPLIT_BYTES
    assert copy_shares(few, 4) == (_whole(few),)


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_shares_deal_small_tensors_whole_and_cut_large_ones_in_a_range_per_thread(threads):
    model = _model(small=600, small_numel=4096)
    model |= {f"x{i}": torch.empty(_LARGE_NUMEL + i, device="meta") for i in range(2)}
    spec = WeightSpec.of(model)
    shares = copy_shares(spec, threads)
    assert len(shares) == threads
    pieces = sorted(piece for share in shares for piece in share)
    for index, entry in enumerate(spec.tensors):  # every byte once
        ranges = [(p.start, p.stop) for p in pieces if p.tensor == index]
        assert ranges[0][0] == 0 and ranges[-1][1] == entry.nbytes, entry.name
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), entry.name
        assert len(ranges) == (threads if entry.nbytes >= DEAL_BELOW_BYTES else 1), entry.name
    large = {i for i, e in enumerate(spec.tensors) if e.nbytes >= DEAL_BELOW_BYTES}
    assert len(large) == 2
    for k, share in enumerate(shares):  # range k of each large tensor in share k
        cut = [p for p in share if p.tensor in large]
        assert len(cut) == 2 and all(p.start == cut[0].start for p in cut)
        assert all(p.start % CUT_ALIGN == 0 for p in cut)
        assert (cut[0].start == 0) == (k == 0)
    dealt_bytes = [sum(p.stop for p in share if p.tensor not in large) for share in shares]
    largest = max(e.nbytes for i, e in enumerate(spec.tensors) if i not in large)
    assert max(dealt_bytes) - min(dealt_bytes) <= 2 * largest


@pytest.mark.parametrize("threads", [2, 3])
def test_empty_tensors_beside_only_large_ones_are_copied(threads):
    """Every tensor dealt whole is empty: nothing to deal by bytes (was a division by
    zero for any copy on two threads or more)."""
    sources = [torch.randn(_LARGE_NUMEL), torch.zeros(0), torch.randn(_LARGE_NUMEL)]
    spec = WeightSpec.of({f"t{i}": t for i, t in enumerate(sources)})
    assert len(copy_shares(spec, threads)) == threads
    destinations = [torch.zeros_like(t) for t in sources]
    copy_all(destinations, sources, spec, threads=threads)
    for d, s in zip(destinations, sources, strict=True):
        assert torch.equal(d, s)


def test_a_pool_handed_out_still_takes_work_after_a_larger_one_is_made():
    """Another thread asking for more copy threads must not shut down the pool a first
    thread got and is about to submit to."""
    first = executor(1)
    executor(64)
    assert first.submit(lambda: 42).result() == 42


@pytest.mark.parametrize("bad", [0, -1], ids=["in the caller's share", "in a helper thread's"])
def test_a_failing_copy_raises(bad):
    model = _model(small=600, small_numel=4096)
    spec = WeightSpec.of(model)
    sources = [model[name] for name in spec.names]
    destinations = [torch.zeros_like(t) for t in sources]
    destinations[bad] = torch.zeros(3)  # a copy that cannot broadcast into it
    with pytest.raises(RuntimeError, match=r"size of tensor a \(3\) must match"):
        copy_all(destinations, sources, spec, threads=2)


def test_a_failing_copy_raises_once_every_other_thread_stopped_writing(monkeypatch):
    """A receiver that sees the copy fail opens its safe point again: no helper thread
    may still be writing into the model then."""
    import raysync.copies as copies

    model = {f"l{i}": torch.zeros(_LARGE_NUMEL * 8) for i in range(3)}
    spec = WeightSpec.of(model)
    sources = [model[name] for name in spec.names]
    destinations = [torch.ones_like(t) for t in sources]
    shares = copy_shares(spec, 3)
    raised, ends = threading.Event(), []
    real_copy = copies._copy

    def copy(destinations, sources, share):
        if share is shares[1]:
            raised.set()
            raise RuntimeError("this share failed")
        assert raised.wait(10), "the failing share never ran"
        if share is not shares[0]:  # the caller's returns at once: the helper still copies
            real_copy(destinations, sources, share)
        ends.append(share)

    monkeypatch.setattr(copies, "_copy", copy)
    with pytest.raises(RuntimeError, match="this share failed"):
        copy_all(destinations, sources, spec, threads=3)
    assert shares[2] in ends  # the other helper's share ended before copy_all raised


@pytest.mark.parametrize("sides", ["tensors", "viewed"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_small_tensors_with_or_without_their_views_are_copied_bit_for_bit(threads, sides):
    model = _model(small=600, small_numel=4096)
    spec = WeightSpec.of(model)
    sources = [model[name] for name in spec.names]
    destinations = [torch.zeros_like(t) for t in sources]
    copy_all(*_sides(sides, destinations, sources), spec, threads=threads)
    for name, d, s in zip(spec.names, destinations, sources, strict=True):
        assert torch.equal(d.view(torch.uint8), s.view(torch.uint8)), name


@pytest.mark.parametrize("sides", ["tensors", "viewed"])
@pytest.mark.parametrize("threads", [1, 2])
def test_middle_sized_tensors_of_every_kind_are_copied_exactly(threads, sides):
    """Tensors dealt and copied alone: of dtypes NumPy lacks (bfloat16), requiring grad,
    non-contiguous destinations, and pairs that cast (float32 into float64): each lands
    as ``copy_`` would land it, whether copy_all gets the tensors or their views."""
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
    assert len(copy_shares(spec, threads)) == threads
    copy_all(*_sides(sides, destinations, sources), spec, threads=threads)
    for i, (d, e) in enumerate(zip(destinations, expected, strict=True)):
        assert d.dtype == e.dtype and torch.equal(d.detach(), e), i


@pytest.mark.parametrize("sides", ["tensors", "viewed"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_large_tensors_of_every_kind_are_copied_exactly(threads, sides):
    """Tensors cut in ranges (or left whole to torch where memcpy cannot copy them): of
    dtypes NumPy lacks, requiring grad, non-contiguous, and pairs that cast; beside
    small ones in the same shares."""
    generator = torch.Generator().manual_seed(11)
    numel = _LARGE_NUMEL
    sources = [
        torch.randn(numel, generator=generator).to(dtype)
        for dtype in (torch.bfloat16, torch.float32, torch.float32, torch.float16, torch.float64)
    ]
    sources.append(torch.randn(4, 1000, generator=generator))  # a small one among them
    destinations = [
        torch.zeros_like(sources[0]),  # bfloat16 into bfloat16
        torch.nn.Parameter(torch.zeros_like(sources[1])),
        torch.zeros(numel, 2, dtype=torch.float32)[:, 0],  # strided: torch copies it whole
        torch.zeros(numel, dtype=torch.float32),  # a cast: torch copies it whole
        torch.zeros(numel, dtype=torch.float64),
        torch.zeros(4, 1000),
    ]
    spec = WeightSpec.of({f"t{i}": d for i, d in enumerate(destinations)})
    expected = [torch.zeros_like(d).copy_(s) for d, s in zip(destinations, sources, strict=True)]
    copy_all(*_sides(sides, destinations, sources), spec, threads=threads)
    for i, (d, e) in enumerate(zip(destinations, expected, strict=True)):
        assert d.dtype == e.dtype and torch.equal(d.detach(), e), i


def test_viewed_arrays_make_their_tensors_once_in_each_dtype():
    """A reader's arrays become tensors only when asked, once, each in its torch dtype
    (a bfloat16 tensor travels as an int16 array), sharing the arrays' memory."""
    sources = [torch.randn(5).to(torch.bfloat16), torch.arange(4, dtype=torch.int64)]
    arrays = [numpy_view(source) for source in sources]
    for array in arrays:
        array.setflags(write=False)
    staged = Viewed.over(arrays, [source.dtype for source in sources])
    assert len(staged) == 2 and staged.arrays[0].dtype.name == "int16"
    first = list(staged)
    assert [t.dtype for t in first] == [torch.bfloat16, torch.int64]
    assert all(torch.equal(t, s) for t, s in zip(first, sources, strict=True))
    assert first[0].data_ptr() == sources[0].data_ptr()
    assert staged[0] is first[0] and list(staged[0:1]) == [first[0]]


def test_tensors_numpy_cannot_view_are_left_as_they_are():
    on_meta = [torch.empty(3, device="meta")]
    assert viewed(on_meta) is on_meta
    conjugate = [torch.zeros(3, dtype=torch.complex64).conj()]
    assert viewed(conjugate) is conjugate


def test_a_model_made_under_inference_mode_takes_a_cast_version_whole():
    """Its tensors are inference tensors, which refuse an in-place write outside
    inference mode: a copy by torch (a cast, a small tensor, a GPU) failed partway, the
    tensors before the failing one holding the new version."""
    with torch.inference_mode():
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(4, 4))
    targets = destinations(model, what="model").tensors
    spec = WeightSpec.of(targets)
    sources = {n: torch.randn(t.shape).to(torch.bfloat16) for n, t in targets.items()}
    copy_all(
        viewed([targets[n] for n in spec.names]), viewed([sources[n] for n in spec.names]), spec
    )
    assert all(torch.equal(targets[n], sources[n].float()) for n in spec.names)


def _upcast_bfloat16(module, state, prefix, local_metadata) -> None:
    """A state_dict post hook that hands out float32 copies of the bfloat16 tensors."""
    for name, tensor in list(state.items()):
        if tensor.dtype == torch.bfloat16:
            state[name] = tensor.float()


@pytest.mark.parametrize("sides", ["tensors", "viewed"])
def test_a_module_whose_state_dict_hook_upcasts_takes_each_version_cast_to_its_dtype(sides):
    """Its state_dict hook hands out float32 copies: a version was copied into those
    copies, the bfloat16 parameters never changed, and every version was acked as
    applied. The version is loaded through load_state_dict now, bit for bit what
    casting it to bfloat16 makes."""
    model = torch.nn.Linear(64, 16).to(torch.bfloat16)
    model.register_state_dict_post_hook(_upcast_bfloat16)
    destination = destinations(model, what="model")
    targets = destination.tensors
    spec = WeightSpec.of(targets)
    generator = torch.Generator().manual_seed(7)
    version = {name: torch.randn(t.shape, generator=generator) for name, t in targets.items()}
    copy_all(
        *_sides(
            sides,
            [targets[name] for name in spec.names],
            [version[name] for name in spec.names],
        ),
        spec,
    )
    if destination.commit is not None:  # as the receiver applies a version
        destination.commit()
    for name, parameter in model.named_parameters():
        assert parameter.dtype == torch.bfloat16, name
        expected = version[name].to(torch.bfloat16)
        assert torch.equal(parameter.detach().view(torch.int16), expected.view(torch.int16)), name

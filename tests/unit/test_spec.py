"""WeightSpec (raysync/spec.py): one instance per spec in a process, a compact pickle
that comes back as that instance, every dtype intact."""

from __future__ import annotations

import pickle

import pytest
import torch

from raysync.spec import TensorSpec, WeightSpec

_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float64,
    torch.complex64,
    torch.int8,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def _tensors(count: int = 3, rows: int = 2) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.zeros(rows, 3) for i in range(count)}


def test_the_same_names_shapes_and_dtypes_give_the_same_instance():
    first = WeightSpec.of(_tensors())
    assert WeightSpec.of(_tensors()) is first  # new tensors, same entries
    assert WeightSpec.of(dict(reversed(_tensors().items()))) is first  # order does not count
    other_shape = WeightSpec.of(_tensors(rows=4))
    other_dtype = WeightSpec.of({n: t.double() for n, t in _tensors().items()})
    other_names = WeightSpec.of(_tensors(count=4))
    for other in (other_shape, other_dtype, other_names):
        assert other is not first and other != first
    assert first.tensors[0] == TensorSpec.of("layer0.weight", (2, 3), torch.float32)


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_a_spec_pickles_to_an_equal_spec_of_every_dtype(dtype):
    spec = WeightSpec(
        (
            TensorSpec.of("a", (2, 3), dtype),
            TensorSpec.of("b", (), dtype),
            TensorSpec.of("c", (0,), dtype),
        )
    )
    back = pickle.loads(pickle.dumps(spec))
    assert back == spec and back.digest == spec.digest
    assert [t.dtype for t in back.tensors] == [dtype] * 3
    assert [t.shape for t in back.tensors] == [(2, 3), (), (0,)]


def test_unpickling_the_same_spec_again_gives_the_instance_unpickled_first():
    """What a hub sees: each broadcast carries the learner's spec; the hub compares it with
    the one it knows by identity and hashes its digest once."""
    spec = WeightSpec.of({f"w{i}": torch.zeros(i + 1) for i in range(1000)})
    data = pickle.dumps(spec)
    first = pickle.loads(data)
    assert pickle.loads(pickle.dumps(spec)) is first
    assert first == spec and first is not spec
    different = pickle.loads(pickle.dumps(WeightSpec.of({"w0": torch.zeros(2)})))
    assert different is not first and different != first

"""raysync/wire_dtype.py: what travels when a wire dtype is asked for, and bad input."""

from __future__ import annotations

import pytest
import torch

from raysync import weights as weights_module
from raysync.errors import InvalidWeightsError
from raysync.spec import WeightSpec
from raysync.wire_dtype import (
    cast_to_wire,
    check_finite_on_wire,
    check_wire_dtype,
    wire_spec_of,
)


def _weights() -> dict[str, torch.Tensor]:
    return {
        "w": torch.randn(4, 3),
        "b": torch.randn(3, dtype=torch.float64),
        "steps": torch.arange(3),
        "mask": torch.tensor([True, False]),
        "half": torch.randn(2).half(),
    }


def test_floating_tensors_travel_cast_and_others_as_they_are():
    weights = _weights()
    wire_spec = wire_spec_of(WeightSpec.of(weights), torch.bfloat16)
    wire = cast_to_wire(weights, wire_spec)
    assert {k: v.dtype for k, v in wire.items()} == {
        "w": torch.bfloat16,
        "b": torch.bfloat16,
        "steps": torch.int64,
        "mask": torch.bool,
        "half": torch.float16,  # as wide as the wire: it would save nothing (test below)
    }
    assert wire["steps"] is weights["steps"] and wire["mask"] is weights["mask"]
    assert wire["half"] is weights["half"]
    assert torch.equal(wire["w"], weights["w"].to(torch.bfloat16))
    assert wire_spec == WeightSpec.of(wire)
    assert wire_spec.nbytes < WeightSpec.of(weights).nbytes


def test_nothing_to_cast_sends_the_weights_themselves():
    weights = {"w": torch.randn(3, dtype=torch.bfloat16), "steps": torch.arange(3)}
    spec = WeightSpec.of(weights)
    assert wire_spec_of(spec, torch.bfloat16) is None
    assert all(cast_to_wire(weights, spec)[k] is weights[k] for k in weights)  # no copy
    assert wire_spec_of(WeightSpec.of(_weights()), None) is None


def test_a_wire_dtype_wider_than_the_weights_is_refused_naming_them():
    weights = {"w": torch.randn(3, dtype=torch.bfloat16), "x": torch.randn(2)}
    with pytest.raises(InvalidWeightsError, match=r"float32 is wider .*w \(torch.bfloat16\)"):
        wire_spec_of(WeightSpec.of(weights), torch.float32)


@pytest.mark.parametrize(
    "weights_dtype, wire", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)]
)
def test_a_tensor_as_wide_as_the_wire_dtype_in_another_format_travels_as_it_is(
    weights_dtype, wire
):
    """float16 weights on a bfloat16 wire were cast, saving no byte: 65504 travelled as
    65536 and every receiver's float16 tensor held Inf (past a hub that rejects
    non-finite weights: it looked at the wire's values only), and every value lost
    three bits. They travel as they are; a wider tensor beside them is still cast."""
    weights = {"layer": torch.tensor([1.0, 65504.0], dtype=weights_dtype), "x": torch.ones(2)}
    wire_spec = wire_spec_of(WeightSpec.of(weights), wire)
    assert wire_spec is not None
    assert {e.name: e.dtype for e in wire_spec.tensors} == {"layer": weights_dtype, "x": wire}
    sent = cast_to_wire(weights, wire_spec)
    assert sent["layer"] is weights["layer"]
    only_it = {"layer": weights["layer"]}
    assert wire_spec_of(WeightSpec.of(only_it), wire) is None  # nothing to cast at all


@pytest.mark.parametrize("bad", [torch.int8, torch.bool, "bfloat16", None])
def test_a_wire_dtype_must_be_a_floating_dtype(bad):
    with pytest.raises(ValueError, match="floating torch dtype"):
        check_wire_dtype(bad)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_float8_wire_dtype_is_refused_saying_why(fp8):
    """float8_e4m3fn saturates (1e6 arrives as 448): neither the receiver nor the check
    for non-finite values (torch has no isfinite for it) could tell."""
    with pytest.raises(ValueError, match=rf"wire_dtype {fp8} is not one .* clipped, not as Inf"):
        check_wire_dtype(fp8)


def test_values_the_wire_dtype_cannot_hold_are_refused_naming_the_key(monkeypatch):
    """float16 overflows to Inf from 65520: with reject_nonfinite the cast must not make
    the Inf the hub refuses. Checked a chunk at a time; bfloat16 holds float32's range."""
    monkeypatch.setattr(weights_module, "NONFINITE_CHUNK_ELEMENTS", 5)
    weights = {"w": torch.zeros(12), "steps": torch.arange(3)}
    weights["w"][[3, 11]] = torch.tensor([7e4, -65520.0])
    spec = WeightSpec.of(weights)
    with pytest.raises(InvalidWeightsError, match=r"key 'w' \(torch.float32, torch.float16 on"):
        check_finite_on_wire(weights, wire_spec_of(spec, torch.float16), what="broadcast")
    with pytest.raises(InvalidWeightsError, match="holds 2 value"):
        check_finite_on_wire(weights, wire_spec_of(spec, torch.float16), what="broadcast")
    half = wire_spec_of(spec, torch.float16)  # a whole version: the cast made already
    with pytest.raises(InvalidWeightsError, match="holds 2 value"):
        check_finite_on_wire(weights, half, what="broadcast", cast=cast_to_wire(weights, half))
    check_finite_on_wire(weights, wire_spec_of(spec, torch.bfloat16), what="broadcast")
    weights["w"][[3, 11]] = torch.tensor([65504.0, -65519.0])  # round to float16's largest
    check_finite_on_wire(weights, wire_spec_of(spec, torch.float16), what="broadcast")

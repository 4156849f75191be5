"""raysync/wire_dtype.py: what travels when a wire dtype is asked for, and bad input."""

from __future__ import annotations

import pickle
import re

import pytest
import torch

import raysync
from raysync import weights as weights_module
from raysync.errors import InvalidWeightsError
from raysync.spec import WeightSpec
from raysync.wire_dtype import (
    AS_IS,
    AsIs,
    cast_to_wire,
    check_finite_on_wire,
    check_wire_dtype,
    resolve_wire_dtype,
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
    for non-finite values (torch has no isfinite for it) could tell; float8_e5m2 keeps
    two bits of mantissa."""
    with pytest.raises(ValueError, match=rf"wire_dtype {fp8} is not one .* saturates"):
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


def test_as_is_bypasses_the_hubs_wire_dtype_and_none_keeps_it():
    """``broadcast.remote(w, wire_dtype=raysync.AS_IS)`` on a hub whose default is
    bfloat16: no wire spec, so the learner sends the tensors themselves, in their own
    dtypes. None is the hub's default; a dtype is that dtype."""
    assert raysync.AS_IS is AS_IS
    assert pickle.loads(pickle.dumps(AS_IS)) is AS_IS  # a learner actor handed it by Ray
    assert resolve_wire_dtype(None, torch.bfloat16) is torch.bfloat16
    assert resolve_wire_dtype(torch.float16, torch.bfloat16) is torch.float16
    assert resolve_wire_dtype(AS_IS, torch.bfloat16) is None
    weights = _weights()
    spec = WeightSpec.of(weights)
    assert wire_spec_of(spec, resolve_wire_dtype(None, torch.bfloat16)) is not None
    assert wire_spec_of(spec, resolve_wire_dtype(AS_IS, torch.bfloat16)) is None
    sent = cast_to_wire(weights, spec)  # what travels without a wire spec
    assert all(sent[name] is tensor for name, tensor in weights.items())


@pytest.mark.parametrize(
    "narrow, hub_default",
    [
        (torch.float8_e4m3fn, torch.bfloat16),
        (torch.float8_e5m2, torch.float16),
        (torch.float16, torch.float32),
    ],
)
def test_a_model_narrower_than_the_hubs_wire_dtype_goes_through_as_it_is(narrow, hub_default):
    """A floating tensor narrower than the hub's default failed every broadcast of its
    model; AS_IS sends that model in its own dtypes."""
    weights = {"w": torch.randn(4), "q": torch.randn(3).to(narrow)}
    spec = WeightSpec.of(weights)
    with pytest.raises(InvalidWeightsError, match=rf"{hub_default} is wider .*q \({narrow}\)"):
        wire_spec_of(spec, resolve_wire_dtype(None, hub_default))
    assert wire_spec_of(spec, resolve_wire_dtype(AS_IS, hub_default)) is None


def test_as_is_for_the_hubs_default_is_no_default():
    """``WeightHub.remote(wire_dtype=raysync.AS_IS)``: the same as None (the hub's
    config holds a dtype or None)."""
    assert resolve_wire_dtype(AS_IS, None) is None
    assert resolve_wire_dtype(None, None) is None
    assert resolve_wire_dtype(torch.bfloat16, None) is torch.bfloat16


@pytest.mark.parametrize("hub_default", [None, torch.bfloat16])
@pytest.mark.parametrize("bad", ["bfloat16", "AS_IS", AsIs, torch.int8, 16])
def test_a_wire_dtype_neither_a_dtype_nor_as_is_is_refused_naming_it(bad, hub_default):
    with pytest.raises(ValueError, match=rf"or raysync.AS_IS, got {re.escape(repr(bad))}$"):
        resolve_wire_dtype(bad, hub_default)


def test_a_float8_wire_dtype_is_refused_over_the_hubs_default():
    with pytest.raises(ValueError, match=r"wire_dtype torch.float8_e4m3fn is not one"):
        resolve_wire_dtype(torch.float8_e4m3fn, torch.bfloat16)

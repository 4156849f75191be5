"""A narrower dtype on the wire: floating tensors travel cast, receivers cast back.

Called in the learner process by ``HubHandle.broadcast`` (:func:`resolve_wire_dtype`,
:func:`wire_spec_of`, then :func:`cast_to_wire` for a version sent whole; a bucketed
one is cast piece by piece as it is packed) and by ``WeightHub.remote`` (the hub's
default, :func:`resolve_wire_dtype` too). One broadcast passes :data:`AS_IS` to travel
in its own dtypes whatever the hub's default. The model's spec (its own dtypes) is what
the hub checks against the receivers'; the *wire spec* is what the transport carries.
A receiver fetches by the wire spec (``Update.wire_spec``) and copies into its own
tensors, which casts: the model ends equal to ``w.to(wire_dtype).to(its_dtype)``, bit
for bit. Integer and bool tensors, and floating tensors as wide as the wire dtype,
travel as they are: float16 weights on a bfloat16 wire (or the reverse) would save no
byte and change values (float16's 65504 travels as bfloat16's 65536, and arrives as Inf).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import torch

from raysync.errors import InvalidWeightsError
from raysync.spec import WeightSpec
from raysync.weights import nonfinite_count

#: The dtypes weights may travel in. Not the float8 ones: torch has no ``isfinite`` for
#: them (the non-finite check could not run), and float8_e4m3fn saturates without Inf
#: (1e6 arrives as 448), so a receiver could not tell either.
WIRE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class AsIs(enum.Enum):
    """The type of :data:`AS_IS`, its only value."""

    AS_IS = "as it is"


#: ``hub.broadcast.remote(w, wire_dtype=raysync.AS_IS)``: this broadcast's tensors travel
#: in their own dtypes, whatever the hub's default wire dtype (``None`` means that
#: default). Given to ``WeightHub.remote`` it is the same as ``None``: no default.
AS_IS = AsIs.AS_IS


def resolve_wire_dtype(
    asked: torch.dtype | AsIs | None, hub_default: torch.dtype | None
) -> torch.dtype | None:
    """The dtype floating tensors travel in, checked (:func:`check_wire_dtype`), or None
    for their own: ``asked`` if it is a dtype, none for :data:`AS_IS`, ``hub_default``
    for None. Called in the learner process by ``HubHandle.broadcast`` (per broadcast,
    or per part) and by ``WeightHub.remote`` (the hub's default, with no default above
    it)."""
    if asked is None:
        return hub_default
    if asked is AS_IS:
        return None
    return check_wire_dtype(asked)


def check_wire_dtype(wire_dtype: object) -> torch.dtype:
    """``wire_dtype`` if weights may travel in it (:data:`WIRE_DTYPES`); else ValueError."""
    if not isinstance(wire_dtype, torch.dtype) or not wire_dtype.is_floating_point:
        raise ValueError(
            f"wire_dtype must be a floating torch dtype (torch.bfloat16, torch.float16) "
            f"or raysync.AS_IS, got {wire_dtype!r}"
        )
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(
            f"wire_dtype {wire_dtype} is not one weights travel in (float8_e4m3fn saturates, "
            f"1e6 arriving as 448 with no isfinite in torch to tell; float8_e5m2 keeps two "
            f"bits of mantissa); use one of {', '.join(str(d) for d in WIRE_DTYPES)}"
        )
    return wire_dtype


def wire_spec_of(spec: WeightSpec, wire_dtype: torch.dtype | None) -> WeightSpec | None:
    """The spec ``spec``'s tensors travel in with ``wire_dtype``, or None if it is
    ``spec`` itself (no wire dtype, or no floating tensor to cast). For senders that cast
    while they pack (bucketed versions): nothing is cast here.

    Raises :class:`~raysync.InvalidWeightsError`, naming the tensor, if a floating
    tensor is narrower than ``wire_dtype`` (the wire would carry more bytes than the
    weights have: a mistake, never a saving).
    """
    if wire_dtype is None:
        return None
    wire_dtype = check_wire_dtype(wire_dtype)
    wide = wire_dtype.itemsize
    narrower = [
        f"{entry.name} ({entry.dtype})"
        for entry in spec.tensors
        if entry.dtype.is_floating_point and entry.dtype.itemsize < wide
    ]
    if narrower:
        raise InvalidWeightsError(
            f"wire_dtype {wire_dtype} is wider than these weights: {', '.join(narrower[:5])}"
            + (f" and {len(narrower) - 5} more" if len(narrower) > 5 else "")
        )
    if all(_wire_dtype_of(entry.dtype, wire_dtype) == entry.dtype for entry in spec.tensors):
        return None
    return spec.cast(lambda dtype: _wire_dtype_of(dtype, wire_dtype))


def cast_to_wire(
    tensors: Mapping[str, torch.Tensor], wire_spec: WeightSpec
) -> dict[str, torch.Tensor]:
    """``tensors`` in the dtypes of ``wire_spec`` (from :func:`wire_spec_of`): each
    tensor whose dtype differs is cast (a wire-sized copy), the others pass as they are."""
    return {
        entry.name: tensors[entry.name]
        if tensors[entry.name].dtype == entry.dtype
        else tensors[entry.name].to(entry.dtype)
        for entry in wire_spec.tensors
    }


def check_finite_on_wire(
    tensors: Mapping[str, torch.Tensor],
    wire_spec: WeightSpec,
    *,
    what: str,
    cast: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Raise :class:`~raysync.InvalidWeightsError`, naming the key, if a tensor that is
    cast for the wire holds a finite value that the wire dtype cannot (``float16``
    overflows to inf from 65520): a hub that rejects non-finite weights must not let the
    cast make them. ``cast``: the tensors already cast (:func:`cast_to_wire`, a whole
    version), looked at as they are; else each is cast a bounded chunk at a time (a
    bucketed version: no model-sized copy). Either is looked at a chunk at a time
    (:func:`~raysync.weights.nonfinite_count`)."""
    for entry in wire_spec.tensors:
        tensor = tensors[entry.name]
        if tensor.dtype == entry.dtype:
            continue
        overflows = (
            nonfinite_count(cast[entry.name])
            if cast is not None
            else nonfinite_count(tensor, as_dtype=entry.dtype)
        )
        if overflows:
            raise InvalidWeightsError(
                f"{what}: key {entry.name!r} ({tensor.dtype}, {entry.dtype} on the wire) holds "
                f"{overflows} value(s) of {tensor.numel()} beyond the range of the wire "
                "dtype: cast, they would arrive as Inf (the hub rejects non-finite weights)"
            )


def _wire_dtype_of(dtype: torch.dtype, wire_dtype: torch.dtype) -> torch.dtype:
    """What a tensor of ``dtype`` travels in: ``wire_dtype`` if it is floating and wider."""
    return wire_dtype if dtype.is_floating_point and dtype.itemsize > wire_dtype.itemsize else dtype

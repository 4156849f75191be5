"""Turn the containers users hold (nn.Module, TensorDict, state_dict) into flat tensors.

Two directions, one naming scheme (nested keys joined with ``"."``, as in
``nn.Module.state_dict()``):

* the learner process calls :func:`flatten` on what it broadcasts (read only);
* a receiver process calls :func:`destinations` on its own model to get the tensors
  an update is copied into, in place.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import torch

from raysync.errors import InvalidWeightsError

if TYPE_CHECKING:
    from tensordict import TensorDictBase

#: What ``broadcast`` accepts and what a receiver's model path may point at.
Weights = Union[torch.nn.Module, "TensorDictBase", Mapping[str, Any]]


def is_tensordict(value: Any) -> bool:
    """``isinstance(value, TensorDictBase)``, without importing tensordict.

    A value can only be a TensorDict once its process imported tensordict, so a process
    that never did (most receivers, the hub) does not pay its import: it loads
    ``torch._dynamo``, about 1.3 s of CPU per process, which a restarted receiver would
    spend before catching up.
    """
    tensordict = sys.modules.get("tensordict")
    return tensordict is not None and isinstance(value, tensordict.TensorDictBase)


def flatten(
    weights: Weights, *, what: str = "weights", reject_nonfinite: bool = False
) -> dict[str, torch.Tensor]:
    """Flat, name-sorted ``name -> tensor`` view of ``weights`` (no copy).

    Raises :class:`InvalidWeightsError` naming the key for a non-tensor leaf, a tensor
    subclass that dispatches itself (a DTensor), a sparse, nested or quantized tensor, a
    non-contiguous tensor, a lazily conjugated or negated view (``t.conj()`` of a
    complex tensor), a tensor without data (``meta`` device), NaN/Inf when
    ``reject_nonfinite`` (looked at a bounded chunk at a time: no model-sized mask in
    the learner), or an empty model. Called in the learner process.
    """
    tensors = _flat_tensors(weights, what)
    if not tensors:
        raise InvalidWeightsError(f"{what} hold no tensors: nothing to broadcast")
    tensors = {name: tensors[name] for name in sorted(tensors)}
    for name, tensor in tensors.items():
        _check_dense(name, tensor, what, "; materialize the model first")
        if reject_nonfinite and (tensor.is_floating_point() or tensor.is_complex()):
            bad = nonfinite_count(tensor)
            if bad:
                raise InvalidWeightsError(
                    f"{what}: key {name!r} holds {bad} NaN/Inf value(s) of "
                    f"{tensor.numel()} (the hub rejects non-finite weights)"
                )
        if not tensor.is_contiguous():
            raise InvalidWeightsError(
                f"{what}: key {name!r} is a non-contiguous view (shape {tuple(tensor.shape)}, "
                f"stride {tensor.stride()}); pass tensor.contiguous() instead"
            )
    # Parameters that require grad cannot be viewed as NumPy arrays; detach only those.
    return {name: t.detach() if t.requires_grad else t for name, t in tensors.items()}


def _check_dense(name: str, tensor: torch.Tensor, what: str, then: str) -> None:
    """InvalidWeightsError naming ``name`` unless ``tensor`` is a plain dense tensor with
    data, whose bytes are the values its shape and dtype say (learner and receiver
    alike: a receiver's model of such tensors registered, then failed every version
    partway through its copy, the tensors before the failing one holding the new
    version). ``then``: what to do about a tensor without data."""
    _check_has_data(name, tensor, what, then)
    _check_plain(name, tensor, what)
    if tensor.is_nested:  # strided layout, and no shape to name
        raise InvalidWeightsError(
            f"{what}: key {name!r} is a nested tensor: weights travel as dense tensors; "
            "pass a padded one (torch.nested.to_padded_tensor) instead"
        )
    if tensor.layout is not torch.strided or tensor.is_quantized:
        kind, instead = (
            ("quantized", "tensor.dequantize()")
            if tensor.is_quantized
            else (f"sparse ({tensor.layout})", "tensor.to_dense()")
        )
        raise InvalidWeightsError(
            f"{what}: key {name!r} is a {kind} tensor (shape {tuple(tensor.shape)}): "
            f"weights travel as dense tensors; pass {instead} instead"
        )
    if tensor.is_conj() or tensor.is_neg():
        lazily = "conjugated" if tensor.is_conj() else "negated"
        raise InvalidWeightsError(
            f"{what}: key {name!r} is a lazily {lazily}"
            f" view (shape {tuple(tensor.shape)}); pass tensor.resolve_conj().resolve_neg()"
        )


def _check_plain(name: str, tensor: torch.Tensor, what: str) -> None:
    """InvalidWeightsError naming ``name`` for a tensor subclass that dispatches its
    operations itself (a DTensor of an FSDP2 or tensor-parallel learner, a torchao
    tensor): its bytes are not the tensor its shape says, and a copy of it may be a
    collective of every rank."""
    if type(tensor).__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        return
    kind = type(tensor).__name__
    instead = (
        "tensor.full_tensor(), or each rank's tensor.to_local() as its part "
        "(part=rank, parts=world)"
        if kind == "DTensor"
        else "a plain torch.Tensor"
    )
    raise InvalidWeightsError(
        f"{what}: key {name!r} is a {kind} (a tensor subclass, shape "
        f"{tuple(tensor.shape)}, dtype {tensor.dtype}): weights travel as plain tensors; "
        f"pass {instead}"
    )


#: Floating dtypes that hold no NaN or Inf (and that torch has no kernel to look at).
_FINITE_ONLY = frozenset(
    dtype for dtype in (getattr(torch, "float4_e2m1fn_x2", None),) if dtype is not None
)

#: Elements :func:`nonfinite_count` looks at a time: its memory, whatever the tensor.
NONFINITE_CHUNK_ELEMENTS = 1 << 22


def nonfinite_count(tensor: torch.Tensor, as_dtype: torch.dtype | None = None) -> int:
    """How many of ``tensor``'s values are NaN or Inf, cast to ``as_dtype`` first if
    given (what that cast would make), a bounded chunk at a time (``torch.isfinite`` of
    a whole tensor made masks and a copy several times its size). float8 chunks are
    looked at in float32: torch has no ``isfinite`` for them."""
    if tensor.dtype in _FINITE_ONLY and as_dtype is None:
        return 0
    flat = tensor.detach().reshape(-1)
    bad = 0
    for chunk in flat.split(NONFINITE_CHUNK_ELEMENTS):
        if as_dtype is not None:
            chunk = chunk.to(as_dtype)
        if chunk.is_floating_point() and chunk.element_size() == 1:
            chunk = chunk.float()
        bad += chunk.numel() - int(torch.isfinite(chunk).sum())
    return bad


@dataclass(frozen=True)
class Destination:
    """Where a receiver writes an update: tensors that share storage with its model.

    ``commit`` is called after the copy for models that are only reachable through
    ``state_dict()`` / ``load_state_dict()`` (modules whose state_dict hooks make copies
    among them); for other modules, TensorDicts and plain dicts the copy itself is the
    update and ``commit`` is ``None``.
    """

    tensors: dict[str, torch.Tensor]
    commit: Callable[[], None] | None = None


def destinations(model: Any, *, what: str) -> Destination:
    """The in-place write targets of a receiver's model. Called in the receiver process.
    Raises :class:`InvalidWeightsError` naming the key of a tensor a version cannot be
    copied into whole, as :func:`flatten` refuses them (on the meta device a copy does
    nothing: every version would be acked, none held; a sparse or subclass one fails
    partway), or a module's extra state (:func:`_check_no_extra_state`); and for a
    model that holds no tensors, as :func:`flatten` refuses one (registered first, its
    empty spec became the hub's, and every broadcast and receiver after it was refused
    as the one at fault)."""
    destination = _write_targets(model, what)
    if not destination.tensors:
        raise InvalidWeightsError(f"{what} holds no tensors: nothing to receive a version into")
    return destination


def _write_targets(model: Any, what: str) -> Destination:
    """:func:`destinations`, empty or not."""
    if isinstance(model, torch.nn.Module):
        _check_no_extra_state(model, what)
        tensors = _flat_tensors(model, what)
        own = _own_tensor_of(model)
        if all(own(tensor) is not None for tensor in tensors.values()):
            return Destination(_writable(tensors, what))
        # A state_dict hook made copies (an upcast, say): a version copied into them
        # reached nothing the module keeps, and was acked as applied. It is loaded
        # instead, through the module's load hooks, as a checkpoint of it would be.
        return _loaded_through_state_dict(model, what)
    if isinstance(model, Mapping) or is_tensordict(model):
        tensors = _writable(_flat_tensors(model, what), what)
        rebuilt = _built_on_access(model, tensors, what)
        if not rebuilt:
            return Destination(tensors)
        # A lazily stacked TensorDict builds its leaves anew on each access: a copy
        # into them reaches nothing the model keeps. It is written back through it.
        if not is_tensordict(model):
            raise InvalidWeightsError(
                f"{what}: key {rebuilt[0]!r} is built anew on each access (a lazily "
                "stacked TensorDict inside a mapping): a version copied into it would be "
                "lost; register the TensorDict itself, or a dense one (.contiguous())"
            )
        keys = {_leaf_name(key): key for key, _ in _tensordict_leaves(model)}

        def write_back() -> None:
            with torch.no_grad():  # in place, into leaves that may require grad
                for name in rebuilt:
                    model.set_(keys[name], tensors[name])

        return Destination(tensors, commit=write_back)
    if callable(getattr(model, "state_dict", None)) and callable(
        getattr(model, "load_state_dict", None)
    ):
        return _loaded_through_state_dict(model, what)
    raise InvalidWeightsError(
        f"{what} is a {type(model).__name__}: expected an nn.Module, a TensorDict, a "
        "mapping of tensors (state_dict) or an object with state_dict()/load_state_dict()"
    )


def _loaded_through_state_dict(model: Any, what: str) -> Destination:
    """Write targets for a model reached only through ``state_dict()`` (whose tensors
    may be copies): its state, which ``commit`` hands to its ``load_state_dict()``."""
    state = model.state_dict()
    return Destination(
        _writable(_flat_tensors(state, what), what),
        commit=lambda: model.load_state_dict(state),
    )


def _writable(tensors: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    for name, tensor in tensors.items():
        _check_dense(
            name,
            tensor,
            what,
            ": a version copied into it would be lost; materialize the model first "
            "(module.to_empty(device=...))",
        )
    return tensors


def _check_no_extra_state(module: torch.nn.Module, what: str) -> None:
    """InvalidWeightsError naming the submodule whose extra state (``get_extra_state``)
    its ``state_dict`` holds: built anew on each call, its tensors took a version's
    copy that reached nothing (``set_extra_state`` is never called), every version
    acked as applied."""
    for prefix, submodule in module.named_modules():
        if type(submodule).get_extra_state is not torch.nn.Module.get_extra_state:
            key = f"{prefix}.{_EXTRA_STATE}" if prefix else _EXTRA_STATE
            raise InvalidWeightsError(
                f"{what}: key {key!r} is the extra state of a {type(submodule).__name__} "
                "(get_extra_state), made anew on each state_dict(): a version copied into "
                "it would be lost; register a mapping of the module's other tensors, and "
                "set that state yourself (on_weights_applied)"
            )


#: The ``state_dict`` key of a module's extra state (torch's ``_EXTRA_STATE_KEY_SUFFIX``).
_EXTRA_STATE = "_extra_state"


def _check_has_data(name: str, tensor: torch.Tensor, what: str, then: str) -> None:
    """InvalidWeightsError naming ``name`` if ``tensor`` is on the meta device (no data),
    the message ending with ``then``: what to do (learner and receiver alike)."""
    if tensor.is_meta:
        raise InvalidWeightsError(
            f"{what}: key {name!r} is on the meta device and holds no data "
            f"(shape {tuple(tensor.shape)}){then}"
        )


def own_tensors(model: Any, names: tuple[str, ...]) -> dict[str, torch.Tensor] | None:
    """The tensor objects ``model`` itself holds under ``names`` (parameters and buffers
    of an nn.Module, leaves of a TensorDict or a mapping), whose storage a zero-copy
    receiver replaces with ``tensor.data = view``. Called in the receiver process.

    ``None`` when replacing would not reach the model: it is only reachable through
    ``state_dict()``, a module's state_dict entry of a name is not one of its parameters
    or buffers but a copy a state_dict hook made (rebinding the parameter to a view of
    the copy's dtype or shape broke the model), or a container builds its leaves on
    each access (a lazily stacked TensorDict). A module's tensors are named as its
    state_dict names them (a renaming hook, as checkpoint_wrapper's, included).
    """
    if isinstance(model, torch.nn.Module):
        own = _own_tensor_of(model)
        state = model.state_dict(keep_vars=True)
        found = {n: mine for n, value in state.items() if (mine := own(value)) is not None}
    elif isinstance(model, Mapping) or is_tensordict(model):
        found = _flat_tensors(model, "model")
        # A lazily stacked TensorDict (also inside a mapping) builds new leaves on each
        # access: replacing their storage would reach nothing the model keeps.
        if _built_on_access(model, {n: found[n] for n in names if n in found}, "model"):
            return None
    else:
        return None
    if any(name not in found for name in names):
        return None
    return {name: found[name] for name in names}


_DATA_PTR = torch.Tensor.data_ptr
_SHAPE = operator.attrgetter("shape")


def storage_fingerprint(model: Any) -> tuple[Any, ...] | None:
    """What a model's cached :class:`Destination` stays valid for: the model, and the
    identity, address and shape of each of its tensors. ``None`` for models only
    reachable through ``state_dict()`` (whose tensors are made anew on each call), and
    for containers with a leaf :func:`destinations` refuses (it says why). Called in
    the receiver at each update's safe point (and when staging an update of a spec
    other than the one last found), so it maps torch's accessors over the tensors
    into one tuple per attribute: a generator of one tuple per tensor took ~3.7 ms
    per call in a receiver's thread for 1000 tensors, this ~1.2 ms.

    ``module.to(...)``, a replaced parameter or dict entry, or a resized buffer
    changes it, so an update is never copied into tensors the model no longer uses.
    A lazily stacked TensorDict builds new leaves on each access, so its fingerprint
    never repeats and its destination is rebuilt each time, as it must be.
    """
    if isinstance(model, torch.nn.Module):
        tensors = _module_tensors(model)
        return (id(model), tuple(map(_DATA_PTR, tensors)), tuple(map(_SHAPE, tensors)))
    if isinstance(model, Mapping) or is_tensordict(model):
        try:
            flat = _flat_tensors(model, "model")
        except InvalidWeightsError:
            return None
        tensors = list(flat.values())
        return (
            id(model),
            tuple(flat),
            tuple(map(id, tensors)),
            tuple(map(_DATA_PTR, tensors)),
            tuple(map(_SHAPE, tensors)),
        )
    return None


def _own_tensor_of(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """For an entry of ``module``'s state_dict, the parameter or buffer it is: itself,
    or the one whose memory it views exactly (a hook that returns ``p.detach()``);
    None for a copy one of its state_dict hooks made."""
    tensors = _module_tensors(module)
    by_id = {id(tensor): tensor for tensor in tensors}
    by_view = {_view_of(tensor): tensor for tensor in tensors if tensor.numel()}

    def own(entry: torch.Tensor) -> torch.Tensor | None:
        if id(entry) in by_id:
            return entry
        return by_view.get(_view_of(entry)) if entry.numel() else None

    return own


def _view_of(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same memory, read alike."""
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride())


def _module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``module`` and its submodules, in a fixed order
    (a tensor shared by two submodules comes twice): one walk of the modules, where
    ``parameters()`` and ``buffers()`` walk them twice through generators."""
    tensors: list[torch.Tensor | None] = []
    for submodule in module.modules():
        tensors.extend(submodule._parameters.values())
        tensors.extend(submodule._buffers.values())
    return [tensor for tensor in tensors if tensor is not None]


def _flat_tensors(weights: Any, what: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """``weights`` as flat ``"a.b.c"`` names (each after ``prefix``) -> tensors."""
    if isinstance(weights, torch.nn.Module):
        # The parameters and buffers themselves (not copies), under state_dict names and
        # through the module's state_dict hooks.
        weights = weights.state_dict(keep_vars=True)
    if is_tensordict(weights):
        out: dict[str, torch.Tensor] = {}
        for key, value in _tensordict_leaves(weights):
            name = prefix + _leaf_name(key)
            if not isinstance(value, torch.Tensor):
                raise InvalidWeightsError(
                    f"{what}: key {name!r} is a {type(value).__name__}, not a tensor"
                )
            _put(out, name, value, what)
        return out
    if isinstance(weights, Mapping):
        out = {}
        _flatten_mapping(weights, prefix, out, what)
        return out
    raise InvalidWeightsError(
        f"{what} is a {type(weights).__name__}: expected an nn.Module, a TensorDict or a "
        "mapping of tensors (state_dict)"
    )


def _built_on_access(model: Any, found: Mapping[str, torch.Tensor], what: str) -> list[str]:
    """The names of ``found`` (leaves of ``model``, a mapping or a TensorDict, walked
    once) that a second walk finds as other tensors: built anew on each access (a
    lazily stacked TensorDict's), so nothing written into them reaches the model."""
    again = _flat_tensors(model, what)
    return [name for name, tensor in found.items() if again.get(name) is not tensor]


def _tensordict_leaves(weights: Any) -> Iterator[tuple[str | tuple[str, ...], Any]]:
    """A TensorDict's leaves, nested ones too, as ``(key, value)``; NonTensorData
    counts as a leaf, so it can be refused."""
    from tensordict import NonTensorData, NonTensorStack, TensorDictBase

    def leaf_or_non_tensor(cls: type) -> bool:
        return not issubclass(cls, TensorDictBase) or issubclass(
            cls, (NonTensorData, NonTensorStack)
        )

    yield from weights.items(include_nested=True, leaves_only=True, is_leaf=leaf_or_non_tensor)


def _leaf_name(key: str | tuple[str, ...]) -> str:
    """A TensorDict key as a flat ``"a.b.c"`` name."""
    return key if isinstance(key, str) else ".".join(key)


def _flatten_mapping(
    mapping: Mapping[str, Any], prefix: str, out: MutableMapping[str, torch.Tensor], what: str
) -> None:
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            _put(out, name, value, what)
        elif is_tensordict(value):
            for sub, tensor in _flat_tensors(value, what, f"{name}.").items():
                _put(out, sub, tensor, what)
        elif isinstance(value, Mapping):
            _flatten_mapping(value, f"{name}.", out, what)
        else:
            raise InvalidWeightsError(
                f"{what}: key {name!r} is a {type(value).__name__}, not a tensor"
            )


def _put(
    out: MutableMapping[str, torch.Tensor], name: str, tensor: torch.Tensor, what: str
) -> None:
    """``out[name] = tensor``, refusing a second tensor under the same flat name
    (``{"a.b": x, "a": {"b": y}}``): one of them would silently never be sent."""
    if name in out:
        raise InvalidWeightsError(
            f"{what}: two tensors flatten to the same name {name!r} (a key with a dot "
            "beside a nested one); rename one of them"
        )
    out[name] = tensor

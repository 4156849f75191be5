"""raysync/weights.py without Ray: what a learner broadcasts and where a receiver writes.

``flatten`` of an nn.Module (buffers and tied weights included), a TensorDict and a
nested state_dict: state_dict names, name order, no copy, detached. Refusals that name
the key: non-tensor leaves (also inside TensorDicts), non-contiguous views, meta
tensors, NaN/Inf when asked, empty or unsupported containers. ``destinations`` writes in
place into modules, TensorDicts and dicts, and through ``load_state_dict`` otherwise (a
module whose state_dict hooks make copies included), and refuses a model without tensors;
``own_tensors`` and ``storage_fingerprint`` follow the model's own tensor objects.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict

from raysync.errors import InvalidWeightsError
from raysync.receiver_zero_copy import rebind
from raysync.weights import destinations, flatten, own_tensors, storage_fingerprint


class _Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        self.head = torch.nn.Linear(4, 2)
        self.register_buffer("scale", torch.tensor(0.5))


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(2, 2, bias=False)
        self.unembed = torch.nn.Linear(2, 2, bias=False)
        self.unembed.weight = self.embed.weight


class _StateOnly:
    """Reachable only through state_dict()/load_state_dict(), which copy (like an optimizer
    or a jitted wrapper): writing the state_dict's tensors alone changes nothing."""

    def __init__(self) -> None:
        self.weight = torch.zeros(3)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.weight = state["weight"].clone()


class _EmptyState:
    """Reachable through state_dict()/load_state_dict(), and holding nothing."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


def _message(excinfo: pytest.ExceptionInfo) -> str:
    return str(excinfo.value)


# -- flatten -------------------------------------------------------------------------------


def test_a_module_flattens_to_its_state_dict_sorted_by_name_without_a_copy():
    module = _Policy()
    flat = flatten(module)
    state = module.state_dict()
    assert list(flat) == sorted(state)
    assert "body.1.running_mean" in flat and "body.1.num_batches_tracked" in flat
    assert "scale" in flat
    for name, tensor in flat.items():
        assert tensor.data_ptr() == state[name].data_ptr(), name
        assert tensor.dtype == state[name].dtype and tensor.shape == state[name].shape
        assert not tensor.requires_grad, name
    # No copy: a change to the module shows through the flat view.
    with torch.no_grad():
        module.head.bias.fill_(7.0)
    assert torch.equal(flat["head.bias"], torch.full((2,), 7.0))


def test_tied_weights_keep_both_names_sharing_one_storage():
    flat = flatten(_Tied())
    assert list(flat) == ["embed.weight", "unembed.weight"]
    assert flat["embed.weight"].data_ptr() == flat["unembed.weight"].data_ptr()


def test_a_nested_state_dict_flattens_with_dotted_names():
    a, b, c = torch.arange(3.0), torch.ones(2, 2), torch.tensor(5, dtype=torch.int64)
    flat = flatten({"z": {"inner": {"leaf": a}}, "m": b, "k": {"x": c}})
    assert list(flat) == ["k.x", "m", "z.inner.leaf"]
    assert flat["z.inner.leaf"].data_ptr() == a.data_ptr()  # the tensors, not copies
    assert torch.equal(flat["k.x"], c) and torch.equal(flat["m"], b)


def test_parameters_that_require_grad_come_back_detached_views_of_the_same_data():
    module = torch.nn.Linear(3, 2)
    module.bias.requires_grad_(False)
    flat = flatten(module)
    assert not flat["weight"].requires_grad
    assert flat["weight"].data_ptr() == module.weight.data_ptr()
    assert flat["weight"].numpy().shape == (2, 3)  # what the object store needs of it
    assert flat["bias"].data_ptr() == module.bias.data_ptr()


def test_a_tensordict_and_a_tensordict_inside_a_dict_flatten_with_dotted_names():
    td = TensorDict({"actor": {"w": torch.ones(2, 3), "b": torch.zeros(2)}, "t": torch.ones(1)})
    assert list(flatten(td)) == ["actor.b", "actor.w", "t"]
    flat = flatten({"nets": td, "extra": torch.ones(1)})
    assert list(flat) == ["extra", "nets.actor.b", "nets.actor.w", "nets.t"]
    assert flat["nets.actor.w"].data_ptr() == td["actor", "w"].data_ptr()


def test_a_parameter_that_requires_grad_comes_out_detached():
    weight = torch.nn.Parameter(torch.ones(2))
    flat = flatten({"w": weight})
    assert not flat["w"].requires_grad
    assert flat["w"].data_ptr() == weight.data_ptr()


@pytest.mark.parametrize(
    "weights, expected",
    [
        ({"a": {"b": 3}}, "weights: key 'a.b' is a int, not a tensor"),
        ({"a": torch.ones(1), "opt": [1.0]}, "weights: key 'opt' is a list, not a tensor"),
        (
            TensorDict({"x": {"y": torch.ones(2), "tag": NonTensorData("hi")}}),
            "weights: key 'x.tag' is a NonTensorData, not a tensor",
        ),
    ],
    ids=["int-in-dict", "list-in-dict", "non-tensor-in-tensordict"],
)
def test_a_non_tensor_leaf_is_refused_naming_its_key(weights, expected):
    with pytest.raises(InvalidWeightsError) as excinfo:
        flatten(weights)
    assert _message(excinfo) == expected


def test_a_non_contiguous_tensor_is_refused_naming_key_shape_and_stride():
    weights = {"enc": {"w": torch.ones(3, 4).t()}, "ok": torch.ones(2)}
    with pytest.raises(InvalidWeightsError) as excinfo:
        flatten(weights, what="the policy")
    assert _message(excinfo) == (
        "the policy: key 'enc.w' is a non-contiguous view (shape (4, 3), stride (1, 4)); "
        "pass tensor.contiguous() instead"
    )


def test_a_sliced_parameter_of_a_module_is_refused():
    module = torch.nn.Linear(4, 4)
    module.weight = torch.nn.Parameter(torch.ones(4, 8)[:, ::2])
    with pytest.raises(InvalidWeightsError, match=r"key 'weight' is a non-contiguous view"):
        flatten(module)


@pytest.mark.parametrize(
    "view, kind",
    [
        (torch.ones(3, dtype=torch.complex64).conj(), "conjugated"),
        (torch._neg_view(torch.ones(3)), "negated"),
    ],
    ids=["conj", "neg"],
)
def test_a_lazily_conjugated_or_negated_view_is_refused_naming_its_key(view, kind):
    """Its bytes are the tensor's before the conjugation: NumPy refused it later, in
    the transport, with an error naming no key."""
    with pytest.raises(InvalidWeightsError) as excinfo:
        flatten({"z": view, "ok": torch.ones(2)})
    assert _message(excinfo) == (
        f"weights: key 'z' is a lazily {kind} view (shape (3,)); "
        "pass tensor.resolve_conj().resolve_neg()"
    )


def test_a_meta_tensor_is_refused_naming_its_key():
    with pytest.raises(InvalidWeightsError) as excinfo:
        flatten({"w": torch.empty(2, 5, device="meta")})
    assert _message(excinfo) == (
        "weights: key 'w' is on the meta device and holds no data (shape (2, 5)); "
        "materialize the model first"
    )


@pytest.mark.parametrize("form", ["module", "state_dict holder"])
def test_a_receiver_model_on_the_meta_device_is_refused_naming_its_key(form):
    """A copy into a meta tensor does nothing: each version was acked, none held."""
    model = torch.nn.Linear(4, 2, device="meta")

    class Holder:  # reachable through state_dict()/load_state_dict() only
        state_dict = model.state_dict
        load_state_dict = model.load_state_dict

    with pytest.raises(InvalidWeightsError) as excinfo:
        destinations(model if form == "module" else Holder(), what="model 'policy'")
    assert _message(excinfo) == (
        "model 'policy': key 'weight' is on the meta device and holds no data (shape (2, 4)): "
        "a version copied into it would be lost; materialize the model first "
        "(module.to_empty(device=...))"
    )


def test_non_finite_values_are_refused_only_when_asked():
    bad = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0])
    weights = {"a.ok": torch.ones(3), "b.bad": bad, "c.ints": torch.arange(3)}
    assert list(flatten(weights)) == ["a.ok", "b.bad", "c.ints"]
    with pytest.raises(InvalidWeightsError) as excinfo:
        flatten(weights, reject_nonfinite=True)
    assert _message(excinfo) == (
        "weights: key 'b.bad' holds 3 NaN/Inf value(s) of 5 (the hub rejects non-finite weights)"
    )
    bf16 = {"w": torch.tensor([float("inf")], dtype=torch.bfloat16)}
    with pytest.raises(InvalidWeightsError, match="key 'w' holds 1 NaN/Inf"):
        flatten(bf16, reject_nonfinite=True)
    flatten({"w": torch.ones(2, dtype=torch.bfloat16)}, reject_nonfinite=True)


def test_non_finite_values_are_counted_a_chunk_at_a_time_float8_included(monkeypatch):
    """float8 weights on a hub that rejects non-finite ones raised torch's own
    NotImplementedError ("isfinite" not implemented for 'Float8_e4m3fn'), naming no key;
    and the count over a whole tensor made masks and a copy several times its size in
    the learner. A bad value in a later chunk is still counted."""
    from raysync import weights as weights_module

    monkeypatch.setattr(weights_module, "NONFINITE_CHUNK_ELEMENTS", 4)
    fp8 = {"a.fp8": torch.zeros(9, dtype=torch.float8_e4m3fn), "b": torch.ones(3)}
    assert list(flatten(fp8, reject_nonfinite=True)) == ["a.fp8", "b"]
    e5m2 = torch.zeros(9, dtype=torch.float8_e5m2)
    e5m2[8] = float("inf")
    with pytest.raises(InvalidWeightsError, match="key 'late' holds 1 NaN/Inf value.* of 9"):
        flatten({"late": e5m2}, reject_nonfinite=True)
    wide = torch.ones(10)
    wide[[1, 9]] = float("nan")
    with pytest.raises(InvalidWeightsError, match="key 'w' holds 2 NaN/Inf value.* of 10"):
        flatten({"w": wide}, reject_nonfinite=True)


def test_a_dtensor_is_refused_naming_the_key_and_what_to_send():
    """An FSDP2 or tensor-parallel learner's parameters: flatten let them through, and
    the send failed in NumPy or in a copy with an error naming no key."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = DTensor.from_local(torch.ones(4, 2), mesh)
        with pytest.raises(InvalidWeightsError, match=r"key 'layer.w' is a DTensor.*to_local"):
            flatten({"layer.w": sharded, "layer.b": torch.zeros(2)})
    finally:
        dist.destroy_process_group()


class _Logged(torch.Tensor):
    """A tensor subclass that dispatches its operations itself (as torchao's do)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Logged:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, _Logged) else t  # noqa: E731
        return func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def test_a_tensor_subclass_that_dispatches_itself_is_refused_naming_the_key():
    with pytest.raises(InvalidWeightsError, match=r"key 'w' is a _Logged .*plain torch.Tensor"):
        flatten({"w": _Logged(torch.ones(3))})
    plain = flatten({"w": torch.nn.Parameter(torch.ones(3))})  # a Parameter is plain
    assert torch.equal(plain["w"], torch.ones(3))


@pytest.mark.parametrize(
    "tensor, kind, instead",
    [
        (torch.eye(3).to_sparse(), r"sparse \(torch.sparse_coo\)", "to_dense"),
        (torch.eye(3).to_sparse_csr(), r"sparse \(torch.sparse_csr\)", "to_dense"),
        (
            torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
            "quantized",
            "dequantize",
        ),
    ],
    ids=["coo", "csr", "quantized"],
)
def test_sparse_and_quantized_tensors_are_refused_naming_the_key(tensor, kind, instead):
    """A sparse tensor was told to pass tensor.contiguous(), which fails too (CSR raised
    torch's own error, naming no key); a quantized one was taken, to fail when packed."""
    with pytest.raises(InvalidWeightsError, match=rf"key 'q.w' is a {kind} tensor .*{instead}"):
        flatten({"q.w": tensor, "b": torch.ones(2)})


@pytest.mark.parametrize(
    "weights, expected",
    [
        ({}, "weights hold no tensors: nothing to broadcast"),
        ({"a": {}}, "weights hold no tensors: nothing to broadcast"),
        (torch.nn.ReLU(), "weights hold no tensors: nothing to broadcast"),
        (
            [torch.ones(1)],
            "weights is a list: expected an nn.Module, a TensorDict or a mapping of tensors "
            "(state_dict)",
        ),
        (
            torch.ones(2),
            "weights is a Tensor: expected an nn.Module, a TensorDict or a mapping of tensors "
            "(state_dict)",
        ),
    ],
    ids=["empty-dict", "empty-nested", "module-without-weights", "list", "bare-tensor"],
)
def test_empty_or_unsupported_weights_are_refused(weights, expected):
    with pytest.raises(InvalidWeightsError) as excinfo:
        flatten(weights)
    assert _message(excinfo) == expected


def test_invalid_weights_error_is_a_value_error():
    with pytest.raises(ValueError):
        flatten({})


# -- destinations --------------------------------------------------------------------------


def test_destinations_of_a_module_write_its_parameters_and_buffers_in_place():
    module = _Policy()
    destination = destinations(module, what="model 'policy'")
    assert destination.commit is None
    assert sorted(destination.tensors) == sorted(module.state_dict())
    with torch.no_grad():
        destination.tensors["head.weight"].copy_(torch.full((2, 4), 3.0))
        destination.tensors["body.1.running_var"].copy_(torch.full((4,), 9.0))
        destination.tensors["body.1.num_batches_tracked"].copy_(torch.tensor(42))
    assert torch.equal(module.head.weight.detach(), torch.full((2, 4), 3.0))
    assert torch.equal(module.body[1].running_var, torch.full((4,), 9.0))
    assert module.body[1].num_batches_tracked.item() == 42


def test_destinations_of_a_dict_and_a_tensordict_write_in_place():
    state = {"enc": {"w": torch.zeros(2, 2)}, "b": torch.zeros(3)}
    destination = destinations(state, what="model")
    assert destination.commit is None
    destination.tensors["enc.w"].copy_(torch.ones(2, 2))
    assert torch.equal(state["enc"]["w"], torch.ones(2, 2))

    td = TensorDict({"actor": {"w": torch.zeros(4)}})
    destination = destinations(td, what="model")
    destination.tensors["actor.w"].copy_(torch.arange(4.0))
    assert torch.equal(td["actor", "w"], torch.arange(4.0))


def test_destinations_of_a_state_dict_only_model_commit_through_load_state_dict():
    model = _StateOnly()
    destination = destinations(model, what="model")
    assert list(destination.tensors) == ["weight"]
    destination.tensors["weight"].copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(model.weight, torch.zeros(3))  # not there until the commit
    assert destination.commit is not None
    destination.commit()
    assert torch.equal(model.weight, torch.tensor([1.0, 2.0, 3.0]))


def test_destinations_of_an_unsupported_model_name_it():
    with pytest.raises(InvalidWeightsError) as excinfo:
        destinations([torch.ones(1)], what="model 'policy' of Collector")
    assert _message(excinfo) == (
        "model 'policy' of Collector is a list: expected an nn.Module, a TensorDict, a "
        "mapping of tensors (state_dict) or an object with state_dict()/load_state_dict()"
    )


def test_destinations_refuse_a_non_tensor_leaf_naming_the_key():
    with pytest.raises(InvalidWeightsError) as excinfo:
        destinations({"w": torch.ones(1), "step": 3}, what="model 'policy'")
    assert _message(excinfo) == "model 'policy': key 'step' is a int, not a tensor"


@pytest.mark.parametrize(
    "model",
    [torch.nn.Module(), torch.nn.ReLU(), {}, {"a": {}}, TensorDict({}, []), _EmptyState()],
    ids=["module", "module-without-weights", "dict", "nested-dict", "tensordict", "state-only"],
)
def test_destinations_refuse_a_model_without_tensors_as_flatten_does(model):
    """Accepted, it registered: first on a hub, its empty spec became the hub's, and
    every broadcast and every receiver after it was refused as the one at fault."""
    with pytest.raises(InvalidWeightsError) as excinfo:
        destinations(model, what="model 'policy'")
    assert _message(excinfo) == "model 'policy' holds no tensors: nothing to receive a version into"


def _upcast_bfloat16(module, state, prefix, local_metadata) -> None:
    """A state_dict post hook that hands out float32 copies of the bfloat16 tensors."""
    for name, tensor in list(state.items()):
        if tensor.dtype == torch.bfloat16:
            state[name] = tensor.float()


def _drop_inner_prefix(module, state, prefix, local_metadata) -> None:
    """A state_dict post hook that renames (as checkpoint_wrapper's): same tensors."""
    for name in list(state):
        state[name.replace("inner.", "", 1)] = state.pop(name)


def test_destinations_of_a_module_whose_state_dict_hook_makes_copies_load_through_it():
    """A version was copied into the hook's float32 copies, which reached nothing: the
    bfloat16 parameters never changed and every version was acked as applied."""
    module = torch.nn.Linear(4, 2).to(torch.bfloat16)
    module.register_state_dict_post_hook(_upcast_bfloat16)
    destination = destinations(module, what="model")
    assert {name: t.dtype for name, t in destination.tensors.items()} == {
        "weight": torch.float32,
        "bias": torch.float32,
    }
    version = {"weight": torch.full((2, 4), 1.7), "bias": torch.tensor([-3.3, 0.1])}
    for name, target in destination.tensors.items():
        target.copy_(version[name])
    if destination.commit is not None:  # as the receiver applies a version
        destination.commit()
    for name, parameter in module.named_parameters():
        assert parameter.dtype == torch.bfloat16
        assert torch.equal(
            parameter.detach().view(torch.int16), version[name].bfloat16().view(torch.int16)
        ), name


def test_destinations_of_a_module_whose_state_dict_hook_renames_write_it_in_place():
    module = torch.nn.Module()
    module.inner = torch.nn.Linear(2, 2)
    module.register_state_dict_post_hook(_drop_inner_prefix)
    destination = destinations(module, what="model")
    assert destination.commit is None
    assert destination.tensors == {"weight": module.inner.weight, "bias": module.inner.bias}
    assert own_tensors(module, ("bias", "weight")) == {
        "bias": module.inner.bias,
        "weight": module.inner.weight,
    }


# -- own_tensors and storage_fingerprint ---------------------------------------------------


def test_own_tensors_of_a_module_are_its_parameter_and_buffer_objects():
    module = _Policy()
    names = ("body.0.weight", "body.1.running_mean", "head.bias", "scale")
    own = own_tensors(module, names)
    assert list(own) == list(names)
    assert own["body.0.weight"] is module.body[0].weight
    assert own["body.1.running_mean"] is module.body[1].running_mean
    assert own["head.bias"] is module.head.bias
    assert own["scale"] is module.scale
    assert own_tensors(module, ("head.bias", "no.such.name")) is None


def test_own_tensors_of_a_mapping_and_a_tensordict_are_their_leaves():
    leaf = torch.zeros(2)
    assert own_tensors({"a": {"b": leaf}}, ("a.b",))["a.b"] is leaf
    td = TensorDict({"x": {"y": torch.zeros(3)}})
    assert own_tensors(td, ("x.y",))["x.y"] is td["x", "y"]


def test_own_tensors_is_none_where_replacing_storage_would_not_reach_the_model():
    lazy = LazyStackedTensorDict.lazy_stack([TensorDict({"w": torch.ones(2)}) for _ in range(2)])
    assert own_tensors(lazy, ("w",)) is None  # leaves are stacked anew on each access
    assert own_tensors({"nets": lazy}, ("nets.w",)) is None
    assert own_tensors(_StateOnly(), ("weight",)) is None


def test_own_tensors_is_none_for_a_module_whose_state_dict_hook_makes_copies():
    """Zero copy rebound the bfloat16 parameters to float32 views of the version; such a
    model is copied into instead, its parameters left as they are."""
    module = torch.nn.Linear(4, 2).to(torch.bfloat16)
    module.register_state_dict_post_hook(_upcast_bfloat16)
    weight = module.weight
    assert own_tensors(module, ("bias", "weight")) is None
    staged = [torch.zeros(2), torch.zeros(2, 4)]
    assert rebind(module, ("bias", "weight"), staged) == "its tensors are reached only by copying"
    assert module.weight is weight and weight.dtype == torch.bfloat16


def _detached(module, state, prefix, local_metadata) -> None:
    for key in list(state):
        state[key] = state[key].detach()


def test_a_module_whose_state_dict_hook_detaches_is_written_in_place_and_adopted():
    """Its entries are other objects over the parameters' own memory: written in place
    (no load_state_dict per version), and zero copy rebinds the parameters."""
    module = torch.nn.Linear(4, 2)
    module.register_state_dict_post_hook(_detached)
    destination = destinations(module, what="model")
    assert destination.commit is None
    destination.tensors["weight"].fill_(3.0)
    assert torch.equal(module.weight, torch.full((2, 4), 3.0))
    own = own_tensors(module, ("bias", "weight"))
    assert own is not None and own["bias"] is module.bias and own["weight"] is module.weight


def test_a_lazily_stacked_tensordict_is_written_back_through_and_refused_inside_a_mapping():
    parts = [TensorDict({"w": torch.ones(2)}) for _ in range(2)]
    lazy = LazyStackedTensorDict.lazy_stack(parts)
    destination = destinations(lazy, what="model")
    destination.tensors["w"].fill_(3.0)  # what a receiver copies a version into
    assert destination.commit is not None
    destination.commit()
    assert all(torch.equal(part["w"], torch.full((2,), 3.0)) for part in parts)
    with pytest.raises(InvalidWeightsError, match=r"key 'nets.w' is built anew"):
        destinations({"nets": lazy}, what="model")


def test_storage_fingerprint_changes_when_the_modules_tensors_move():
    module = torch.nn.Linear(3, 2)
    fingerprint = storage_fingerprint(module)
    assert storage_fingerprint(module) == fingerprint
    with torch.no_grad():
        module.weight.add_(1.0)  # in place: same storage
    assert storage_fingerprint(module) == fingerprint
    module.bias = torch.nn.Parameter(torch.zeros(2))
    replaced = storage_fingerprint(module)
    assert replaced != fingerprint
    module.to(torch.float64)
    assert storage_fingerprint(module) != replaced


def test_storage_fingerprint_of_a_module_with_absent_and_shared_tensors():
    """A parameter registered as None (``bias=False``) is no tensor; a tensor two
    submodules share still counts, so replacing either use changes the fingerprint."""
    first, second = torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False)
    second.weight = first.weight
    module = torch.nn.Sequential(first, second, torch.nn.BatchNorm1d(3))
    fingerprint = storage_fingerprint(module)
    assert fingerprint is not None and storage_fingerprint(module) == fingerprint
    second.weight = torch.nn.Parameter(torch.zeros(3, 3))
    assert storage_fingerprint(module) != fingerprint
    unshared = storage_fingerprint(module)
    module[2].running_mean.resize_(6)  # a buffer resized in place: same object
    assert storage_fingerprint(module) != unshared


@pytest.mark.parametrize("container", [dict, TensorDict], ids=["dict", "TensorDict"])
def test_storage_fingerprint_of_a_container_follows_its_entries(container):
    model = container({"w": torch.ones(2), "nets": {"b": torch.zeros(3)}})
    fingerprint = storage_fingerprint(model)
    assert fingerprint is not None and storage_fingerprint(model) == fingerprint
    model["w"].add_(1.0)  # in place: same tensor, same storage
    assert storage_fingerprint(model) == fingerprint
    model["w"] = torch.ones(2)  # a new tensor under the same key
    replaced = storage_fingerprint(model)
    assert replaced != fingerprint
    model["extra"] = torch.ones(1)
    assert storage_fingerprint(model) != replaced
    assert storage_fingerprint(container({"w": torch.ones(2)})) != storage_fingerprint(model)


def test_storage_fingerprint_is_none_where_the_destination_is_rebuilt_each_time():
    assert storage_fingerprint(_StateOnly()) is None
    assert storage_fingerprint({"w": torch.ones(1), "note": "not a tensor"}) is None
    lazy = LazyStackedTensorDict.lazy_stack([TensorDict({"w": torch.ones(2)}) for _ in range(2)])
    assert storage_fingerprint(lazy) != storage_fingerprint(lazy)


def test_a_refused_leaf_inside_a_nested_tensordict_is_named_by_its_full_key():
    weights = {"nets": TensorDict({"note": NonTensorData("hi"), "w": torch.zeros(2)}, [])}
    with pytest.raises(InvalidWeightsError, match=r"key 'nets\.note' is a NonTensorData"):
        flatten(weights, what="weights")


def test_two_tensors_flattening_to_one_name_are_refused_naming_it():
    weights = {"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}}
    with pytest.raises(InvalidWeightsError, match=r"two tensors flatten to the same name 'a\.b'"):
        flatten(weights, what="weights")


@pytest.mark.parametrize(
    "tensor, kind",
    [
        (torch.eye(3).to_sparse(), r"sparse \(torch.sparse_coo\) tensor"),
        (_Logged(torch.zeros(300, 300)), "_Logged"),
        (torch.ones(3, dtype=torch.complex64).conj(), "lazily conjugated view"),
    ],
    ids=["sparse", "subclass", "conj"],
)
def test_a_receiver_model_of_tensors_it_cannot_be_written_into_is_refused(tensor, kind):
    """Only the learner refused these: a receiver's model of them registered (its spec
    says the logical shape and dtype), then failed every version partway through its
    copy, the tensors before the failing one holding the new version."""
    with pytest.raises(InvalidWeightsError, match=rf"model: key 'b' is a {kind}"):
        destinations({"a": torch.zeros(3), "b": tensor}, what="model")


def test_a_nested_tensor_is_refused_naming_the_key():
    """Strided, it passed every check, then WeightSpec.of raised torch's own error."""
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(InvalidWeightsError, match="key 'n' is a nested tensor"):
        flatten({"n": nested, "w": torch.ones(2)})


def test_packed_float4_weights_pass_the_non_finite_check():
    """float4 holds no NaN or Inf, and torch has no kernel to look: with
    reject_nonfinite the check raised torch's NotImplementedError, naming no key."""
    weights = {"w": torch.zeros(4, dtype=torch.float4_e2m1fn_x2)}
    assert flatten(weights, reject_nonfinite=True)["w"] is weights["w"]


class _Scaled(torch.nn.Module):
    """A module with extra state (as TransformerEngine's FP8 scales)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.scale = 1.0

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        return {"scale": torch.tensor(self.scale)}

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.scale = float(state["scale"])


def test_a_receiver_module_with_extra_state_is_refused_naming_it():
    """Its state_dict makes the extra state anew on each call: a version was copied into
    that copy, set_extra_state never called, and every version acked as applied."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), _Scaled())
    with pytest.raises(InvalidWeightsError, match=r"key '1._extra_state' is the extra state"):
        destinations(model, what="model")

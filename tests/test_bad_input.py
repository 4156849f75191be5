"""Bad input is refused with a message naming the cause, before any receiver changes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import ray
import torch
from tensordict import NonTensorData, TensorDict

from raysync import (
    HubClosedError,
    InvalidWeightsError,
    ModelPathError,
    SpecMismatchError,
    StaleVersionError,
    UnknownModelError,
    UnknownWorkerError,
    WeightHub,
)
from raysync.transports import DEFAULT_TRANSPORT
from tests.helpers import assert_same, ready, start, start_hub
from tests.receivers import Collector, WrongModel, make_policy, state_of


def _good() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in make_policy().state_dict().items()}


def _missing():
    w = _good()
    del w["2.bias"]
    return w


def _extra():
    w = _good()
    w["3.weight"] = torch.zeros(2)
    return w


def _wrong_shape():  # transposed
    w = _good()
    w["0.weight"] = torch.zeros(8, 64)
    return w


def _wrong_dtype():
    w = _good()
    w["0.bias"] = w["0.bias"].double()
    return w


def _non_tensor():
    w = _good()
    w["0.bias"] = [0.0] * 64
    return w


def _non_contiguous():
    w = _good()
    w["0.weight"] = torch.zeros(8, 64).t()
    return w


def _with(key, value):
    def make():
        w = _good()
        w[key] = value
        return w

    return make


def _poisoned(value):
    def make():
        w = _good()
        w["2.weight"][0, 5] = value
        return w

    return make


# (weights factory, error type, words the message must contain)
SPEC_ERRORS = {
    "missing key": (_missing, SpecMismatchError, ["missing key", "'2.bias'"]),
    "extra key": (_extra, SpecMismatchError, ["unexpected key", "'3.weight'"]),
    "wrong shape": (_wrong_shape, SpecMismatchError, ["'0.weight'", "(64, 8)", "(8, 64)"]),
    "wrong dtype": (_wrong_dtype, SpecMismatchError, ["'0.bias'", "float32", "float64"]),
    "bf16 for fp32": (
        _with("2.weight", torch.zeros(2, 64, dtype=torch.bfloat16)),
        SpecMismatchError,
        ["'2.weight'", "bfloat16", "dtype differs"],
    ),
    "scalar for vector": (
        _with("2.bias", torch.tensor(0.0)),
        SpecMismatchError,
        ["'2.bias'", "shape ()", "shape (2,)"],
    ),
    "flattened weight": (
        _with("0.weight", torch.zeros(512)),
        SpecMismatchError,
        ["'0.weight'", "(512,)", "shape differs"],
    ),
    "nested extra key": (
        _with("extra", {"inner": torch.zeros(1)}),
        SpecMismatchError,
        ["'extra.inner'"],
    ),
    "renamed key": (
        lambda: {("layer." + k): v for k, v in _good().items()},
        SpecMismatchError,
        ["missing key", "unexpected key", "'layer.0.weight'"],
    ),
}
LEARNER_ERRORS = {
    "non-tensor leaf": (_non_tensor, InvalidWeightsError, ["'0.bias'", "list"]),
    "non-contiguous": (_non_contiguous, InvalidWeightsError, ["'0.weight'", "non-contiguous"]),
    "empty": (dict, InvalidWeightsError, ["no tensors"]),
    "not weights": (lambda: "weights.pt", InvalidWeightsError, ["str"]),
    "pickled garbage": (
        lambda: b"\x80\x04\x95garbage",
        InvalidWeightsError,
        ["bytes", "expected an nn.Module"],
    ),
    "None leaf": (_with("0.bias", None), InvalidWeightsError, ["'0.bias'", "NoneType"]),
    "int leaf": (_with("0.bias", 3), InvalidWeightsError, ["'0.bias'", "int"]),
    "numpy leaf": (_with("0.bias", np.zeros(64)), InvalidWeightsError, ["'0.bias'", "ndarray"]),
    "NaN": (_poisoned(float("nan")), InvalidWeightsError, ["'2.weight'", "1 NaN/Inf"]),
    "Inf": (_poisoned(float("inf")), InvalidWeightsError, ["'2.weight'", "1 NaN/Inf"]),
    "meta device": (
        lambda: make_policy().to("meta"),
        InvalidWeightsError,
        ["meta device", "'0.bias'"],
    ),
    "empty module": (torch.nn.Module, InvalidWeightsError, ["no tensors"]),
    "empty TensorDict": (lambda: TensorDict({}, []), InvalidWeightsError, ["no tensors"]),
    "non-tensor in TensorDict": (
        lambda: TensorDict({"w": torch.zeros(2), "tag": NonTensorData("v1")}, []),
        InvalidWeightsError,
        ["'tag'"],
    ),
    "strided slice": (
        _with("0.weight", torch.zeros(64, 16)[:, ::2]),
        InvalidWeightsError,
        ["'0.weight'", "non-contiguous", "stride"],
    ),
}


@dataclass(frozen=True)
class Before:
    """A hub and its receiver ``"w0"``, and what they hold as a test starts."""

    hub: object
    collector: object
    version: int
    state: dict[str, torch.Tensor]

    def untouched(self) -> None:
        assert ray.get(self.collector.version.remote()) == self.version
        assert_same(ray.get(self.collector.state.remote()), self.state)
        assert ray.get(self.hub.status.remote()).versions == {"policy": self.version}


@pytest.fixture
def before(shared_hubs, transport) -> Before:
    """The session's hub and receiver on ``transport``, just given a fresh version."""
    hub, collector = shared_hubs.pair(transport)
    learner = make_policy()
    version = ray.get(hub.broadcast.remote(learner)).version
    return Before(hub, collector, version, state_of(learner))


# Bad input is refused in the learner or the hub, before any transport is used: every
# case runs through the default transport, and one case of each kind through every
# transport (the *_every_transport tests below).
@pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])
@pytest.mark.parametrize("case", SPEC_ERRORS, ids=list(SPEC_ERRORS))
def test_spec_mismatch_rejected_by_hub(case, before):
    hub = before.hub
    make, error, words = SPEC_ERRORS[case]
    with pytest.raises(error) as info:
        ray.get(hub.broadcast.remote(make()))
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message}"
    assert "hub's spec of model 'policy'" in message
    before.untouched()
    # The channel is not jammed: the next valid broadcast goes through.
    assert ray.get(hub.broadcast.remote(make_policy())).version == before.version + 1


@pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])
@pytest.mark.parametrize("case", LEARNER_ERRORS, ids=list(LEARNER_ERRORS))
def test_invalid_weights_rejected_in_learner(case, before):
    hub = before.hub
    make, error, words = LEARNER_ERRORS[case]
    with pytest.raises(error) as info:
        hub.broadcast.remote(make())
    for word in words:
        assert word in str(info.value)
    before.untouched()


@pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])
def test_a_value_the_wire_dtype_cannot_hold_is_refused_in_the_learner(before):
    """Finite in float32, Inf once cast to float16 on the wire: refused by a hub that
    rejects non-finite weights, before anything is sent."""
    with pytest.raises(InvalidWeightsError, match=r"'2.weight' .* beyond the range of the wire"):
        before.hub.broadcast.remote(_poisoned(7e4)(), wire_dtype=torch.float16)
    before.untouched()


def test_wrong_shape_every_transport(before):
    test_spec_mismatch_rejected_by_hub("wrong shape", before)


def test_non_tensor_leaf_every_transport(before):
    test_invalid_weights_rejected_in_learner("non-tensor leaf", before)


def test_unknown_model(before):
    hub = before.hub
    with pytest.raises(SpecMismatchError):
        ray.get(hub.broadcast.remote({"x": torch.zeros(2)}, model="policy"))
    with pytest.raises(UnknownModelError, match="unknown model 'critic'"):
        ray.get(hub.latest.remote("critic"))
    before.untouched()


def test_unknown_model_is_refused_naming_the_known_ones(before):
    hub = before.hub
    with pytest.raises(UnknownModelError, match=r"unknown model 'nomodel'.*knows: policy"):
        ray.get(hub.broadcast.remote(make_policy(), model="nomodel"))
    before.untouched()  # and the hub did not start holding a new model


def test_only_declared_models_are_broadcast_before_any_receiver(actors):
    # The positive side (a declared model reaches late joiners) is in test_core.py.
    hub = start_hub(actors, "object_store", models=("policy",))
    report = ray.get(hub.broadcast.remote(make_policy(), model="policy"))
    assert (report.version, report.acked, report.failed) == (1, (), {})
    with pytest.raises(UnknownModelError, match=r"unknown model 'critic'.*knows: policy"):
        ray.get(hub.broadcast.remote(make_policy(), model="critic"))


def test_unknown_worker(before):
    hub = before.hub
    with pytest.raises(UnknownWorkerError, match="unknown worker 'nobody'.*w0"):
        ray.get(hub.broadcast.remote(make_policy(), workers=["w0", "nobody"]))
    before.untouched()


def test_one_worker_named_as_a_str_is_refused_in_the_learner(before):
    with pytest.raises(TypeError, match=r"not a str: workers=\['w0'\]"):
        before.hub.broadcast.remote(make_policy(), workers="w0")
    before.untouched()


def test_ambiguous_default_model(actors):
    hub = start_hub(actors, DEFAULT_TRANSPORT, models=("one", "two"))
    ray.get(hub.broadcast.remote({"a": torch.zeros(1)}, model="one"))
    ray.get(hub.broadcast.remote({"a": torch.zeros(1)}, model="two"))
    with pytest.raises(UnknownModelError, match="several models.*one, two"):
        ray.get(hub.broadcast.remote({"a": torch.zeros(1)}))


def test_receiver_with_mismatching_model_fails_registration(before, actors):
    hub = before.hub
    wrong = start(actors, WrongModel, hub)
    with pytest.raises(ray.exceptions.RayActorError) as info:
        ray.get(wrong.ping.remote())
    message = str(info.value)
    assert "SpecMismatchError" in message and "WrongModel" in message
    assert "'2.weight'" in message and "(2, 64)" in message and "(3, 64)" in message
    status = ray.get(hub.status.remote())
    assert {r.worker for r in status.receivers} == {"w0"}
    # The hub shows whom it refused, and why, until that worker gets in.
    (refusal,) = [r for r in status.refused.values() if r.actor.startswith("WrongModel(")]
    assert refusal.error.startswith("SpecMismatchError: ") and "'2.weight'" in refusal.error
    before.untouched()


@pytest.mark.parametrize("transport", [DEFAULT_TRANSPORT])  # resolved before any transport
def test_bad_model_path_fails_registration(before, actors):
    hub = before.hub

    @ray.remote(num_cpus=0)
    class BadPath(Collector.__ray_actor_class__):
        def __init__(self, hub):
            self.policy = make_policy()
            self.connect_hub(hub, models={"policy": "nets[0].policy"})

    receiver = start(actors, BadPath, hub)
    with pytest.raises(ray.exceptions.RayActorError) as info:
        ray.get(receiver.version.remote())
    assert ModelPathError.__name__ in str(info.value) and "nets[0].policy" in str(info.value)
    before.untouched()


def test_unknown_transport_lists_known_ones(ray_cluster):
    with pytest.raises(ValueError, match="unknown transport 'carrier_pigeon'.*object_store"):
        WeightHub.remote(transport="carrier_pigeon")


@pytest.mark.parametrize("below", [0, 1], ids=["equal to current", "lower than current"])
def test_stale_explicit_version(below, before):
    hub, stale = before.hub, before.version - below
    with pytest.raises(StaleVersionError) as info:
        ray.get(hub.broadcast.remote(make_policy(), version=stale))
    assert (
        f"version {stale} of model 'policy' is not above the current version {before.version}"
        in str(info.value)
    )
    before.untouched()
    jump = before.version + 100
    assert ray.get(hub.broadcast.remote(make_policy(), version=jump)).version == jump
    assert ray.get(before.collector.version.remote()) == jump


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 2.5, True, "3"])
def test_a_version_that_is_no_int_is_refused_in_the_learner(bad, before):
    """NaN passed the "above the current one" check (a NaN compares as nothing): each
    receiver answered it as held (acked) and every later version was numbered NaN too,
    so no receiver took another one while every report said they had."""
    with pytest.raises(ValueError, match=r"version must be an int, got "):
        before.hub.broadcast.remote(make_policy(), version=bad)
    before.untouched()


def test_empty_worker_list(before):
    hub = before.hub
    with pytest.raises(UnknownWorkerError, match="names no receiver"):
        ray.get(hub.broadcast.remote(make_policy(), workers=[]))
    before.untouched()


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("inf"), "10"])
def test_a_timeout_that_is_no_positive_number_is_refused_in_the_learner(before, timeout_s):
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        before.hub.broadcast.remote(make_policy(), timeout_s=timeout_s)
    before.untouched()


def test_garbage_sent_to_the_actor_directly(before):
    hub = before.hub
    with pytest.raises(TypeError, match="BroadcastRequest.*get_hub"):
        ray.get(hub.actor.submit.remote(b"\x80\x04garbage"))
    before.untouched()
    assert ray.get(hub.broadcast.remote(make_policy())).version == before.version + 1


def test_broadcast_while_shutting_down(actors, transport):
    hub = start_hub(actors, transport)
    collector = start(actors, Collector, hub, worker_id="w0")
    ready([collector])
    learner = make_policy()
    ray.get(hub.broadcast.remote(learner))
    ray.get(hub.close.remote())
    with pytest.raises(HubClosedError, match="shutting down"):
        ray.get(hub.broadcast.remote(make_policy()))
    assert ray.get(collector.version.remote()) == 1
    assert_same(ray.get(collector.state.remote()), state_of(learner))


def test_a_broadcast_waiting_for_a_first_receiver_ends_when_the_hub_closes(actors):
    # It would wait its whole timeout for a receiver that will never register.
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    waiting = hub.broadcast.remote(make_policy(), timeout_s=300)
    # A route asked after this learner's broadcast 1 comes once that broadcast had its
    # turn at the hub: it is then waiting for a receiver.
    ray.get(hub.actor.route.remote(None, hub._side.submitter, 1))
    ray.get(hub.close.remote())
    with pytest.raises(HubClosedError, match="shutting down"):
        ray.get(waiting, timeout=60)


# The check is the learner's; NaN and inf crossing every transport bit for bit is the
# conformance kit's (raysync.testing.special_weights).
def test_nonfinite_allowed_unless_configured(actors):
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    collector = start(actors, Collector, hub)
    ready([collector])
    weights = _poisoned(float("nan"))()
    ray.get(hub.broadcast.remote(weights))
    got = ray.get(collector.state.remote())
    assert torch.isnan(got["2.weight"][0, 5]) and torch.equal(got["0.weight"], weights["0.weight"])


def test_a_pull_by_a_worker_the_hub_does_not_know_is_refused_naming_it(actors):
    """``latest`` for a worker the hub no longer knows (it closed, or was dropped when its
    heartbeats stopped) handed back the version as the hub's own transport carries it,
    planned for nobody: a receiver reading by another transport fetched a payload not
    in its form, one by the same transport read with no hold booked for it."""
    hub = start_hub(actors, DEFAULT_TRANSPORT)
    collector = start(actors, Collector, hub, worker_id="c")
    ready([collector])
    ray.get(hub.broadcast.remote(make_policy()))
    with pytest.raises(UnknownWorkerError, match="worker 'ghost' is not registered"):
        ray.get(hub.actor.latest.remote("policy", 0, worker="ghost"))
    assert ray.get(hub.actor.latest.remote("policy", 0, worker="c")).version == 1

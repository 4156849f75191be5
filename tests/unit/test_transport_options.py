"""Transport options: checked where they are built and where the hub is started (no Ray:
every error here is raised before an actor is created)."""

from __future__ import annotations

import dataclasses

import pytest

from raysync import DistributedOptions, HubConfig, RpcOptions, WeightHub
from raysync.transports import get_transport


def test_options_name_the_field_and_the_bad_value():
    with pytest.raises(ValueError, match=r"DistributedOptions.backend='mpi'.*gloo, nccl"):
        DistributedOptions(backend="mpi")
    with pytest.raises(ValueError, match=r"DistributedOptions.timeout_s must be positive, got 0"):
        DistributedOptions(timeout_s=0)
    with pytest.raises(ValueError, match=r"RpcOptions.timeout_s must be positive, got -1"):
        RpcOptions(timeout_s=-1)


def test_each_transport_declares_its_options_class():
    assert get_transport("distributed").options is DistributedOptions
    assert get_transport("rpc").options is RpcOptions
    assert get_transport("object_store").options is None


def test_the_hub_config_finds_a_transports_options_by_class():
    config = HubConfig("object_store", 60.0, False, "id", transport_options=(RpcOptions(5.0),))
    assert config.options_of(RpcOptions) == RpcOptions(5.0)
    assert config.options_of(DistributedOptions) is None  # that transport's defaults
    assert config.options_of(None) is None  # a transport without options
    rpc = config.context("hub-handle", get_transport("rpc"))
    assert (rpc.actor, rpc.hub_id, rpc.options) == ("hub-handle", "id", RpcOptions(5.0))
    assert config.context("hub-handle", get_transport("object_store")).options is None


def test_options_that_belong_to_no_transport_are_refused_before_any_actor():
    with pytest.raises(
        TypeError, match=r"\{'timeout_s': 5\} is not the options of any.*RpcOptions"
    ):
        WeightHub.remote(transport="rpc", options={"timeout_s": 5})


def test_the_same_options_class_twice_is_refused():
    with pytest.raises(TypeError, match="two RpcOptions given"):
        WeightHub.remote(transport="rpc", options=[RpcOptions(1.0), RpcOptions(2.0)])


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RpcOptions().timeout_s = 3.0  # type: ignore[misc]


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), float("inf"), True, "10"])
def test_a_hub_wide_timeout_that_is_no_positive_finite_number_is_refused(timeout_s):
    """NaN and infinity passed a ``<= 0`` check: the learner's first ``ray.get`` then
    raised Ray's own conversion error, the hub's registrations timed out at once (NaN)
    or never (infinity), and True was a one-second timeout."""
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        WeightHub.remote(timeout_s=timeout_s)

"""Transport options: checked where they are built and where the hub is started (no Ray:
every error here is raised before an actor is created)."""

from __future__ import annotations

import dataclasses
import datetime
import re

import pytest

from raysync import DistributedOptions, HubConfig, RpcOptions, WeightHub, get_hub
from raysync.transports import get_transport


def test_options_name_the_field_and_the_bad_value():
    with pytest.raises(ValueError, match=r"DistributedOptions.backend='mpi'.*gloo, nccl"):
        DistributedOptions(backend="mpi")
    with pytest.raises(ValueError, match=r"DistributedOptions.timeout_s must be .*, got 0$"):
        DistributedOptions(timeout_s=0)
    with pytest.raises(ValueError, match=r"RpcOptions.timeout_s must be .*, got -1$"):
        RpcOptions(timeout_s=-1)


OPTIONS_CLASSES = [DistributedOptions, RpcOptions]
#: The longest timeout that ``datetime.timedelta`` holds (in whole days).
LONGEST_TIMEDELTA_S = float(datetime.timedelta.max.days * 86400)


@pytest.mark.parametrize("options", OPTIONS_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "timeout_s", [float("inf"), float("nan"), True, "10", 0.0005, 0, -1, 1e300]
)
def test_an_options_timeout_that_is_no_finite_number_of_milliseconds_is_refused(options, timeout_s):
    """Infinity (and 1e300) passed a ``> 0`` check and then killed the transport's
    actor in its constructor (``timedelta(seconds=inf)`` overflows), failing every
    broadcast with an error that did not name the option; True was a one-second
    timeout; "10" raised a TypeError that named no field; and 0.0005 s became 0 ms,
    which torch's c10d reads as no timeout at all: waits and barriers had no bound."""
    with pytest.raises(
        ValueError,
        match=rf"^{options.__name__}\.timeout_s must be a finite number of seconds of at "
        rf"least 0\.001 \(torch reads less than a millisecond as no timeout\), "
        rf"got {re.escape(repr(timeout_s))}$",
    ):
        options(timeout_s=timeout_s)


@pytest.mark.parametrize("options", OPTIONS_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("timeout_s", [0.001, 30, 30.0, LONGEST_TIMEDELTA_S])
def test_an_options_timeout_from_a_millisecond_up_is_taken(options, timeout_s):
    assert options(timeout_s=timeout_s).timeout_s == timeout_s
    if options is DistributedOptions:  # the timedelta that torch gets: 1 ms at least
        assert DistributedOptions(timeout_s=timeout_s).timeout == datetime.timedelta(
            seconds=timeout_s
        )


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


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), float("inf"), True])
def test_a_hub_lookup_whose_timeout_is_no_positive_finite_number_is_refused(timeout_s):
    """``get_hub`` waits for the hub to appear until its deadline: NaN made one that
    never came (no hub of that name: it looked for good)."""
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        get_hub("no-such-hub", timeout_s=timeout_s)

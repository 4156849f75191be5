"""The ``hub`` argument of ``attach`` and ``connect_hub``, checked without Ray.

A HubHandle or a hub's name goes through (so does a test's stand-in with a HubHandle's
``actor`` and ``config``); anything else (the hub actor's raw Ray ActorHandle from
``ray.get_actor``, an int, None, an object of another class) is a TypeError that says
what to pass instead, raised before the receiver looks at Ray or the hub: no runtime
context is asked for, no hub looked up, nothing registered.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from ray.actor import ActorHandle

from raysync import WeightReceiver
from raysync import attached as attached_module
from raysync.hub_handle import HubHandle

WHAT_TO_PASS = "pass the HubHandle that WeightHub.remote(...) or raysync.get_hub(name) returns"


class NotAHub:
    """An object of a class that is neither a HubHandle nor a str."""


def _raw_actor_handle() -> ActorHandle:
    """An ActorHandle made without Ray, standing for ``ray.get_actor("hub")``. Marked a
    weak reference so that its ``__del__`` asks no Ray worker to drop it."""
    handle = object.__new__(ActorHandle)
    handle.__dict__.update(_ray_weak_ref=True, _method_shells={}, _ray_is_cross_language=False)
    return handle


@pytest.fixture
def nothing_touched(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Make each step ``attach`` takes after the check fail the test (and never start
    Ray): asking for the runtime context, looking a hub up, registering."""
    touched: list[str] = []

    def refuse(step: str) -> Any:
        def step_taken(*args: object, **kwargs: object) -> None:
            touched.append(step)
            raise AssertionError(f"attach went on to {step} with a hub it should refuse")

        return step_taken

    monkeypatch.setattr(attached_module.ray, "get_runtime_context", refuse("ask Ray"))
    monkeypatch.setattr(attached_module, "get_hub", refuse("look the hub up"))
    monkeypatch.setattr(attached_module.ReceiverCore, "register", refuse("register"))
    yield touched
    assert touched == []


def test_a_hub_handle_a_name_or_a_stand_in_goes_through():
    handle = object.__new__(HubHandle)
    assert attached_module._hub_argument(handle) is handle
    assert attached_module._hub_argument("hub") == "hub"
    stand_in = SimpleNamespace(actor=object(), config=object())  # a test's hub
    assert attached_module._hub_argument(stand_in) is stand_in


def test_the_hubs_raw_actor_handle_is_refused_with_what_to_pass_instead():
    with pytest.raises(TypeError, match="Ray ActorHandle") as caught:
        attached_module._hub_argument(_raw_actor_handle())
    assert WHAT_TO_PASS in str(caught.value)
    assert "or the hub's name" in str(caught.value)


@pytest.mark.parametrize(
    ("hub", "named"), [(3, "3 (int)"), (None, "None (NoneType)"), (NotAHub(), "(NotAHub)")]
)
def test_any_other_hub_is_refused_naming_what_was_passed(hub, named):
    with pytest.raises(TypeError, match="hub must be a raysync HubHandle") as caught:
        attached_module._hub_argument(hub)
    assert named in str(caught.value)
    assert WHAT_TO_PASS in str(caught.value)


@pytest.mark.parametrize(
    "hub", [_raw_actor_handle(), 3, None, NotAHub()], ids=lambda hub: type(hub).__name__
)
def test_attach_refuses_it_before_anything_else(nothing_touched, hub):
    with pytest.raises(TypeError, match=r"pass the HubHandle"):
        attached_module.attach(hub, torch.nn.Linear(2, 2))


class _Worker(WeightReceiver):
    def __init__(self) -> None:
        self.policy = torch.nn.Linear(2, 2)


def test_connect_hub_refuses_the_raw_actor_handle_before_anything_else(nothing_touched):
    hub: Any = _raw_actor_handle()  # the mistake under test, which mypy would catch
    with pytest.raises(TypeError, match="Ray ActorHandle"):
        _Worker().connect_hub(hub, "policy")

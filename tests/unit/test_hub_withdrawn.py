"""A registration its receiver withdrew (its register call was not answered in time) is
never booked by the hub, also when the withdrawal comes while the hub still waits to
book it (actors/hub.py), without Ray."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections import OrderedDict
from types import SimpleNamespace

import pytest

from raysync.actors.hub import WeightHubActor
from raysync.errors import RaySyncError


@dataclasses.dataclass(frozen=True)
class _Registration:
    worker: str
    actor: str
    token: str
    transport: str | None = None


def test_a_registration_withdrawn_while_the_hub_waits_for_its_former_one_is_not_booked():
    """The hub dropped the worker and its planner still forgot it; the re-registration
    waited for that past the receiver's own timeout, and the receiver withdrew it. The
    hub booked it all the same: broadcasts targeted a registration nobody held (a
    collective waited for that member) until the next heartbeat."""
    booked: list[str] = []

    async def scenario() -> None:
        forgetting = asyncio.get_running_loop().create_future()
        past_its_first_look = asyncio.Event()  # it found the token not withdrawn yet
        hub = SimpleNamespace(
            _withdrawn=OrderedDict(),
            _transport="object_store",
            _leaving={"w": forgetting},
            _default_timeout_s=30.0,
            _state=SimpleNamespace(
                receivers={},
                knows=lambda worker, token: False,
                register=lambda registration: booked.append(registration.token),
            ),
            _check_registering=lambda registration: None,
            _planner=lambda transport, asked_by: past_its_first_look.set(),
            _drop=lambda worker, token: None,
        )
        hub._check_not_withdrawn = functools.partial(WeightHubActor._check_not_withdrawn, hub)
        registration = _Registration("w", "Collector(w)", "late")
        registering = asyncio.ensure_future(WeightHubActor._register(hub, registration))
        await past_its_first_look.wait()  # then it waits for the former one's forget
        assert not registering.done()
        await WeightHubActor.leave(hub, "w", "late")  # the receiver gave up: withdrawn
        forgetting.set_result(None)
        with pytest.raises(RaySyncError, match="withdrew this registration"):
            await registering

    asyncio.run(scenario())
    assert booked == []

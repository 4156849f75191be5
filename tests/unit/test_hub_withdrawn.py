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
            _drop=lambda worker, token, **how: None,
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


@dataclasses.dataclass(frozen=True)
class _FromProcess:
    worker: str
    actor: str
    token: str
    process: str


@pytest.mark.parametrize("process", ["p1", "p2"])
def test_a_registration_failing_after_its_successor_got_in_leaves_no_refusal(process):
    """The receiver withdrew registration t1 (unanswered in time) and got in as t2; t1
    then failed at the hub ("dropped while it registered"): ``status`` said the worker
    was refused while it received. A refusal of another process's registration (an
    impostor of the worker id) still shows."""
    from raysync.hub_state import ReceiverEntry

    current = ReceiverEntry(_FromProcess("w", "Collector(w)", "t2", "p1"))
    hub = SimpleNamespace(_refused=OrderedDict(), _state=SimpleNamespace(receivers={"w": current}))
    hub._registered_since = functools.partial(WeightHubActor._registered_since, hub)

    async def refused(registration):
        raise RaySyncError("w was dropped while it registered: register again")

    hub._register = refused
    with pytest.raises(RaySyncError):
        asyncio.run(WeightHubActor.register(hub, _FromProcess("w", "Collector(w)", "t1", process)))
    assert ("w" in hub._refused) == (process == "p2")

"""The RPC planner's check of its agent (raysync/transports/rpc/planner.py), without
Ray: an agent that is out of reach for a moment is kept, a dead one replaced."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from raysync.transports.base import TransportError
from raysync.transports.rpc.planner import RpcPlanner


class _Agent:
    """Stands for the agent's actor handle: ``ping`` raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.ping = self
        self.members = self

    async def _raise(self) -> None:
        raise self.error

    def remote(self):
        return self._raise()


def _planner(agent: _Agent) -> RpcPlanner:
    planner = RpcPlanner.__new__(RpcPlanner)  # its agent, without starting one
    planner._name, planner._key, planner._actor = "agent", "k1", agent
    planner._members_of, planner._broker = "k1", None
    planner._start_agent = lambda: ("k2", _Agent(ActorDiedError()))
    return planner


def test_an_agent_out_of_reach_for_a_moment_is_kept():
    """Ray says an actor is unavailable while a network blip lasts: replacing it (as a
    dead one) moved every receiver to a new group, and naming a second agent failed."""
    agent = _Agent(ActorUnavailableError("connection to the actor lost", None))
    planner = _planner(agent)
    with pytest.raises(TransportError, match="did not answer now"):
        asyncio.run(planner._live_agent())
    assert (planner._key, planner._actor) == ("k1", agent)


def test_a_dead_agent_is_replaced():
    planner = _planner(_Agent(ActorDiedError()))
    with pytest.raises(TransportError, match="could not start"):  # the stand-in's members
        asyncio.run(planner._live_agent())
    assert planner._key == "k2"

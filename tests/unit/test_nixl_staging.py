"""The NIXL receiver's staging buffers (raysync/transports/nixl/receiver.py) with a
real NIXL agent, without Ray: a buffer NIXL cannot prepare is refused naming its spec,
and its registration does not outlive it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from raysync.spec import WeightSpec
from raysync.transports.base import TransportError
from raysync.transports.nixl.receiver import NixlReceiver


class _FailingPrep:
    """The receiver's own agent, whose descriptor preparation fails (as when UCX
    refuses the memory); every other call goes to the agent, deregistrations noted."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.registered: list[Any] = []
        self.deregistered: list[Any] = []

    def register_memory(self, tensor: torch.Tensor) -> Any:
        registered = self._agent.register_memory(tensor)
        self.registered.append(registered)
        return registered

    def prep_xfer_dlist(self, *args: Any) -> Any:
        raise RuntimeError("NIXL_ERR_BACKEND (injected)")

    def deregister_memory(self, registered: Any) -> None:
        self.deregistered.append(registered)
        self._agent.deregister_memory(registered)


def test_a_staging_buffer_nixl_cannot_prepare_is_refused_and_deregistered():
    receiver = NixlReceiver()
    agent = _FailingPrep(receiver._agent)
    receiver._agent = agent
    spec = WeightSpec.of({"w": torch.zeros(64), "b": torch.zeros(8)})
    try:
        with pytest.raises(TransportError, match=r"could not prepare the staging buffer of .*w"):
            receiver._new_staging(spec)
        assert agent.deregistered == agent.registered and len(agent.registered) == 1
    finally:
        receiver._agent = agent._agent
        receiver.close()

"""The RDT learner's sender (raysync/transports/rdt/learner.py) without Ray: once
closed, it registers no memory (Ray's NIXL registration stood in for)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray.experimental
import torch

from raysync.spec import WeightSpec
from raysync.transports.base import TransportError
from raysync.transports.rdt import learner as rdt_learner
from raysync.transports.rdt.learner import RdtSender


def test_a_send_after_the_sender_closed_fails_and_registers_nothing(monkeypatch):
    """Another thread's broadcast took the sender before the learner's handle closed
    it: its send registered a fresh pair of model-sized buffers that nothing
    deregistered, and the version went out through the released sender."""
    registered: list[torch.Tensor] = []
    monkeypatch.setattr(ray.experimental, "register_nixl_memory", registered.append)
    monkeypatch.setattr(rdt_learner, "apply_ucx_cuda_defaults", lambda: None)
    monkeypatch.setattr(rdt_learner, "ray_agent_progress", lambda: None)
    monkeypatch.setattr(
        rdt_learner.ray,
        "get_runtime_context",
        lambda: SimpleNamespace(get_actor_id=lambda: None),
    )
    sender = RdtSender(hub=SimpleNamespace())
    sender.close()
    weights = {"w": torch.ones(8)}
    spec = WeightSpec.of(weights)
    with pytest.raises(TransportError, match="closed before version of model 'late'"):
        sender.send(weights, spec, "late")
    with pytest.raises(TransportError, match="closed before a bucketed version"):
        sender.send_buckets(weights, spec, bucket_bytes=16, stall_s=1.0)
    assert registered == []

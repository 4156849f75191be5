"""The policies of TorchRL's own Ray collector tests (``test/test_distributed.py``), in
an importable module: remote collectors unpickle them by reference."""

from __future__ import annotations

import torch
from tensordict.nn import TensorDictModuleBase
from torch import nn


class CountingPolicy(TensorDictModuleBase):
    """Acts with its one weight (1.0 at first) at every step: a batch's actions show the
    weights it was collected with."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(1.0))
        self.in_keys = []
        self.out_keys = ["action"]

    def forward(self, tensordict):
        tensordict.set("action", self.weight.expand(tensordict.shape).clone())
        return tensordict


class MismatchedCountingPolicy(CountingPolicy):
    """A learner policy with a parameter the collectors' policy does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.unexpected = nn.Parameter(torch.ones(()))


class MaskedCountingPolicy(CountingPolicy):
    """Acts with its weight times a buffer it does not save (``persistent=False``, 1.0
    in every process): a batch's actions show whether the buffer travelled."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tensor(1.0), persistent=False)

    def forward(self, tensordict):
        tensordict.set("action", (self.weight * self.mask).expand(tensordict.shape).clone())
        return tensordict


def normalized_counting_env():
    """``CountingEnv`` whose observations an ``ObservationNorm`` shifts by its ``loc``:
    a second model of the collector (``"env.transform"``), besides its policy."""
    from torchrl.envs import ObservationNorm, TransformedEnv
    from torchrl.testing.mocking_classes import CountingEnv

    norm = ObservationNorm(loc=torch.zeros(1), scale=torch.ones(1), in_keys=["observation"])
    return TransformedEnv(CountingEnv(), norm)


class Evaluator:
    """A Ray actor of the user's (no TorchRL collector) that evaluates the policy: it
    attaches its own ``CountingPolicy`` to a named hub's ``"policy"`` as it starts."""

    def __init__(self, hub: str, worker_id: str, policy: type = CountingPolicy) -> None:
        import raysync

        self.policy = policy()
        self.receiver = raysync.attach(hub, {"policy": self.policy}, worker_id=worker_id)

    def weight(self) -> float:
        return self.policy.weight.item()

    def buffers(self) -> dict[str, float]:
        return {name: buffer.item() for name, buffer in self.policy.named_buffers()}

"""A training-ish loop through TorchRL's RayCollector, kept in sync by raysync.

Remote collectors run a small actor on TorchRL's pure-torch Pendulum; the learner fits
that actor to a PD controller on each batch and sends the new weights with
``collector.update_policy_weights_()`` through :class:`raysync.torchrl.RaySyncScheme`.
Every batch is replayed on the learner with the weights sent just before it (the
collectors must have acted with those, "gap sent" ~ 1e-7) and with the version before
("gap prev", which must be far larger).

    pip install raysync[torchrl]
    python examples/torchrl_collector.py --collectors 2 --iterations 10
"""

from __future__ import annotations

import argparse
import copy
import math

import ray
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors.distributed import RayCollector
from torchrl.envs import PendulumEnv

from raysync.torchrl import RaySyncScheme


class Actor(nn.Module):
    """Torque from the pendulum's angle and angular velocity, within its ±2 limit."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        features = torch.stack([th.cos(), th.sin(), thdot], dim=-1)
        return 2.0 * torch.tanh(self.net(features))


def make_policy() -> TensorDictModule:
    return TensorDictModule(Actor(), in_keys=["th", "thdot"], out_keys=["action"])


def pd_torque(th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
    """What the learner fits the actor to: a PD controller towards upright."""
    angle = (th + math.pi) % (2 * math.pi) - math.pi
    return (-(10.0 * angle + 2.0 * thdot)).clamp(-2.0, 2.0).unsqueeze(-1)


#: Collected and replayed actions agree to float rounding (the collectors' processes
#: run other thread counts); one version apart they differ by far more.
SAME = 1e-5


def main(collectors: int, iterations: int, frames: int) -> bool:
    """Run the loop; whether every batch was collected with the weights sent just before
    it (and not with the version before those)."""
    torch.manual_seed(0)
    policy = make_policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    scheme = RaySyncScheme()  # starts a hub of its own, closed with the collector
    collector = RayCollector(
        [PendulumEnv] * collectors,
        policy=policy,
        frames_per_batch=frames * collectors,
        total_frames=frames * collectors * iterations,
        max_frames_per_traj=100,
        sync=True,
        remote_configs={"num_cpus": 0},
        weight_sync_schemes={"policy": scheme},
    )
    collector.update_policy_weights_()  # version 1: what the collectors already hold
    sent = copy.deepcopy(policy)  # what the collectors should be acting with
    previous = None  # the version before that
    ok = True
    print(
        f"{'iter':>4} {'version':>7} {'reward':>8} {'bc loss':>8} {'gap sent':>9} {'gap prev':>9}"
    )
    for iteration, batch in enumerate(collector):
        gap = action_gap(batch, sent)
        gap_previous = None if previous is None else action_gap(batch, previous)
        ok &= gap < SAME and (gap_previous is None or gap_previous > SAME)

        target = pd_torque(batch["th"], batch["thdot"])
        loss = (policy(batch.select("th", "thdot").clone())["action"] - target).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        collector.update_policy_weights_()  # every collector acts with these from now on
        previous, sent = sent, copy.deepcopy(policy)
        reward = batch["next", "reward"].mean().item()
        shown = "-" if gap_previous is None else f"{gap_previous:.2e}"
        print(
            f"{iteration:>4} {scheme.last_report.version:>7} {reward:>8.3f} "
            f"{loss.item():>8.4f} {gap:>9.2e} {shown:>9}"
        )
    collector.shutdown()
    return ok


def action_gap(batch: TensorDict, weights: TensorDictModule) -> float:
    """The largest gap between the batch's actions and those ``weights`` give."""
    with torch.no_grad():
        replayed = weights(batch.select("th", "thdot").clone())["action"]
    return (batch["action"] - replayed).abs().max().item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectors", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--frames", type=int, default=64, help="per collector and batch")
    args = parser.parse_args()
    # The remote collectors print their set-up: keep it out of this script's table.
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    ok = main(args.collectors, args.iterations, args.frames)
    print(f"collectors acted with the weights sent before each batch: {ok}")
    ray.shutdown()
    raise SystemExit(0 if ok else 1)

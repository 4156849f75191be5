"""A real training run: PPO on CartPole, with collectors a WeightHub keeps up to date.

The learner (this driver) trains a policy and a value network with PPO on
gymnasium's CartPole-v1. Four collector actors (``--collectors``) each step an
environment of their own with a copy of the policy (only the policy: the value network
stays with the learner). Each collector is a ``WeightReceiver`` that calls
``connect_hub`` in its ``__init__``. One ``collect`` call gathers ``--steps``
environment steps with the policy version the collector holds, and returns that
version with the batch. ``collect`` is a public method, so it is a reader: no update
lands while it runs, and one version acts for the whole batch.

Collection overlaps learning. Once the learner has an iteration's batches, it waits
for the ack of the version it broadcast last. That ack resolves as soon as every
collector has applied the version, right after the batch it was collecting. The
learner then asks for the next batches at once, trains on the batches it has, and
broadcasts the new policy while the next batches are collected. Each iteration prints
the mean return of the episodes that ended in its batches and each collector's version
lag: the latest version published when the batch arrived minus the version it was
collected with. The lag is 0 for the first batch and 1 from then on, since each batch
is collected while the learner trains the next version. PPO's clipped importance
ratio, taken against the collecting policy's log-probabilities, corrects for that.

Run it: ``python examples/rl_loop.py``. On 2 idle cores it takes about 35 s (10 s
of it starting Ray and the actors); the mean return climbs from ~20 to CartPole's cap
of 500 around iteration 25. Options: ``--iterations``, ``--collectors``, ``--steps``
(per collector per iteration), ``--seed``, and ``--json PATH`` to write the results.
It needs gymnasium (``pip install raysync[examples]``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import ray
import torch
from torch import nn

from raysync import HubHandle, WeightHub, WeightReceiver

MODEL = "policy"
ENV = "CartPole-v1"


def mlp(outputs: int) -> nn.Module:
    """CartPole's observation (4 numbers) through two tanh layers of 64."""
    return nn.Sequential(
        nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, outputs)
    )


def make_policy() -> nn.Module:
    """Observation -> logits of the two actions. The collectors hold the same architecture."""
    return mlp(2)


def make_critic() -> nn.Module:
    """Observation -> state value. It stays with the learner: collectors only act."""
    return mlp(1)


@dataclass(frozen=True)
class Batch:
    """``steps`` consecutive steps of one collector's environment, with one policy version."""

    version: int  # the policy version every action here was sampled from
    obs: torch.Tensor  # [steps + 1, 4]: the observations acted on, then the next one
    actions: torch.Tensor  # [steps]
    log_probs: torch.Tensor  # [steps]: under the collecting policy (PPO's "old" policy)
    rewards: torch.Tensor  # [steps]
    dones: torch.Tensor  # [steps]: 1.0 where an episode ended (the 500-step cap counts too)
    episode_returns: list[float]  # of the episodes that ended in this batch


@ray.remote(num_cpus=1)
class Collector(WeightReceiver):
    def __init__(self, hub: HubHandle, name: str, seed: int) -> None:
        torch.set_num_threads(1)
        self.policy = make_policy()
        self.env = gym.make(ENV)
        self.obs, _ = self.env.reset(seed=seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.episode_return = 0.0
        # Registers the policy and applies the latest version before any method runs.
        self.connect_hub(hub, models={MODEL: "policy"}, worker_id=name)

    def collect(self, steps: int) -> Batch:
        """``steps`` environment steps with the policy held now; updates wait until it returns."""
        version = self.weights_version(MODEL)
        obs, actions, log_probs, rewards, dones = [], [], [], [], []
        episode_returns = []
        with torch.no_grad():
            for _ in range(steps):
                x = torch.as_tensor(self.obs)
                log_p = torch.log_softmax(self.policy(x), dim=-1)
                action = int(torch.multinomial(log_p.exp(), 1, generator=self.generator))
                self.obs, reward, terminated, truncated, _ = self.env.step(action)
                self.episode_return += reward
                done = terminated or truncated
                obs.append(x)
                actions.append(action)
                log_probs.append(log_p[action])
                rewards.append(reward)
                dones.append(done)
                if done:
                    episode_returns.append(self.episode_return)
                    self.episode_return = 0.0
                    self.obs, _ = self.env.reset()
        obs.append(torch.as_tensor(self.obs))
        return Batch(
            version=version,
            obs=torch.stack(obs),
            actions=torch.tensor(actions),
            log_probs=torch.stack(log_probs),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            dones=torch.tensor(dones, dtype=torch.float32),
            episode_returns=episode_returns,
        )


@dataclass(frozen=True)
class PPOConfig:
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    epochs: int = 10
    minibatch: int = 128
    lr: float = 3e-4
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    max_grad_norm: float = 0.5


class Learner:
    """PPO on the driver: the policy it broadcasts and a value network it keeps."""

    def __init__(self, config: PPOConfig) -> None:
        self.config = config
        self.policy = make_policy()
        self.critic = make_critic()
        params = [*self.policy.parameters(), *self.critic.parameters()]
        self.optimizer = torch.optim.Adam(params, lr=config.lr)

    def update(self, batches: list[Batch]) -> None:
        """One PPO update on the batches (each a segment of one environment's steps)."""
        c = self.config
        obs, actions, old_log_probs, advantages, returns = [], [], [], [], []
        with torch.no_grad():
            for b in batches:
                adv, ret = self._gae(b)
                obs.append(b.obs[:-1])
                actions.append(b.actions)
                old_log_probs.append(b.log_probs)
                advantages.append(adv)
                returns.append(ret)
        obs, actions = torch.cat(obs), torch.cat(actions)
        old_log_probs, returns = torch.cat(old_log_probs), torch.cat(returns)
        advantages = torch.cat(advantages)
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        params = [*self.policy.parameters(), *self.critic.parameters()]
        for _ in range(c.epochs):
            for idx in torch.randperm(len(obs)).split(c.minibatch):
                log_p = torch.log_softmax(self.policy(obs[idx]), dim=-1)
                ratio = (log_p.gather(1, actions[idx, None]).squeeze(1) - old_log_probs[idx]).exp()
                clipped = ratio.clamp(1 - c.clip, 1 + c.clip)
                policy_loss = -torch.min(ratio * advantages[idx], clipped * advantages[idx]).mean()
                value_loss = (self.critic(obs[idx]).squeeze(-1) - returns[idx]).pow(2).mean()
                entropy = -(log_p.exp() * log_p).sum(-1).mean()
                loss = policy_loss + c.value_coef * value_loss - c.entropy_coef * entropy
                self.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(params, c.max_grad_norm)
                self.optimizer.step()

    def _gae(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Advantages (GAE) and value targets over one collector's segment, bootstrapped
        from the value of its last observation."""
        c = self.config
        values = self.critic(b.obs).squeeze(-1)
        advantages = torch.zeros_like(b.rewards)
        running = torch.tensor(0.0)
        for t in reversed(range(len(b.rewards))):
            alive = 1.0 - b.dones[t]
            delta = b.rewards[t] + c.gamma * values[t + 1] * alive - values[t]
            running = delta + c.gamma * c.gae_lambda * alive * running
            advantages[t] = running
        return advantages, advantages + values[:-1]


def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The loop: collect (overlapping the update), train, broadcast; one row per iteration."""
    hub = WeightHub.remote(models=[MODEL])  # the learner may publish before collectors register
    collectors = [
        Collector.remote(hub, f"collector-{i}", args.seed + 1 + i) for i in range(args.collectors)
    ]
    torch.manual_seed(args.seed)
    learner = Learner(PPOConfig())
    ack = hub.broadcast.remote(learner.policy, model=MODEL)  # version 1: the initial policy
    # Acked by the collectors registered by then; any other one gets it in connect_hub.
    ray.get(ack)
    pending = [c.collect.remote(args.steps) for c in collectors]
    rows, env_steps = [], 0
    started = time.perf_counter()
    for iteration in range(1, args.iterations + 1):
        batches: list[Batch] = ray.get(pending)
        # The last version's ack resolves once every collector applied it: right after
        # the batch it was collecting. So the next batches use the latest version, and
        # they are collected while this iteration trains and broadcasts the next one.
        latest = ray.get(ack).version
        pending = [c.collect.remote(args.steps) for c in collectors]
        episodes = [r for b in batches for r in b.episode_returns]
        env_steps += sum(len(b.actions) for b in batches)
        row = {
            "iteration": iteration,
            "env_steps": env_steps,
            "mean_return": statistics.fmean(episodes) if episodes else None,
            "episodes": len(episodes),
            "lags": [latest - b.version for b in batches],  # versions behind the learner
            "seconds": time.perf_counter() - started,
        }
        rows.append(row)
        print_row(row)
        learner.update(batches)
        ack = hub.broadcast.remote(learner.policy, model=MODEL)
    ray.get([*pending, ack])
    hub.release()
    return rows


def print_row(row: dict[str, Any]) -> None:
    if row["iteration"] == 1:
        print("iter  env steps  mean return  episodes  lag per collector  time s")
    ret = "-" if row["mean_return"] is None else f"{row['mean_return']:.1f}"
    lags = " ".join(str(lag) for lag in row["lags"])
    print(
        f"{row['iteration']:>4}  {row['env_steps']:>9}  {ret:>11}  {row['episodes']:>8}  "
        f"{lags:<17}  {row['seconds']:>6.1f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--collectors", type=int, default=4)
    parser.add_argument("--steps", type=int, default=512, help="per collector per iteration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    started = time.perf_counter()
    torch.set_num_threads(1)  # small networks; the collectors need the other cores
    ray.init(address="local", num_cpus=max(8, args.collectors + 2), include_dashboard=False)
    try:
        rows = train(args)
    finally:
        ray.shutdown()
    wall = time.perf_counter() - started
    returns = [r["mean_return"] for r in rows if r["mean_return"] is not None]
    print(
        f"wall time {wall:.0f} s ({rows[-1]['seconds']:.0f} s of iterations); mean return "
        f"{returns[0]:.1f} in the first iteration, {returns[-1]:.1f} in the last"
    )
    if args.json is not None:
        result = {"env": ENV, "seed": args.seed, "steps": args.steps, "wall_s": wall, "rows": rows}
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""The README's first example: a hub, four collectors, one broadcast."""

import ray
import torch

from raysync import WeightHub, WeightReceiver


def make_policy() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))


@ray.remote(num_cpus=0)
class Collector(WeightReceiver):  # the mixin; @weight_receiver is the decorator form
    def __init__(self, hub):
        self.policy = make_policy()
        self.connect_hub(hub, models={"policy": "policy"})  # model id -> attribute path on self

    def act(self, obs: torch.Tensor) -> torch.Tensor:
        return self.policy(obs)


if __name__ == "__main__":
    ray.init(address="local", include_dashboard=False)
    hub = WeightHub.remote()  # launched from the Ray job (driver)
    collectors = [Collector.remote(hub) for _ in range(4)]
    learner_policy = make_policy()  # same architecture, trained on the driver
    ack = hub.broadcast.remote(learner_policy)  # nn.Module, TensorDict or state_dict
    report = ray.get(ack)  # resolves once every registered receiver applied it
    print(report.version, report.acked, report.failed, report.seconds, report.bytes)
    obs = torch.randn(1, 8)
    assert torch.equal(ray.get(collectors[0].act.remote(obs)), learner_policy(obs).detach())
    ray.shutdown()

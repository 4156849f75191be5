"""`make demo`: a local Ray cluster, a hub, 4 receivers, a few broadcasts of a ~100 MB model.

Prints one row per broadcast (version, receivers, MB, seconds, GB/s delivered =
MB x receivers / seconds), checks every receiver is bitwise equal to the learner, and
prints the hub's view of every receiver's version and lag.
"""

from __future__ import annotations

import argparse
import hashlib

import ray
import torch

from raysync import WeightHub, WeightReceiver


def make_model(width: int, layers: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


@ray.remote(num_cpus=0)
class Worker(WeightReceiver):
    def __init__(self, hub, width: int, layers: int, name: str):
        self.model = make_model(width, layers)
        self.connect_hub(hub, models={"model": "model"}, worker_id=name)

    def digest(self) -> str:
        return _digest(self.model)


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--receivers", type=int, default=4)
    parser.add_argument("--broadcasts", type=int, default=5)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6, help="6 x 2048^2 fp32 ~ 100 MB")
    parser.add_argument("--transport", default="object_store")
    args = parser.parse_args()

    ray.init(address="local", num_cpus=max(8, args.receivers + 2), include_dashboard=False)
    try:
        hub = WeightHub.remote(transport=args.transport)
        workers = [
            Worker.remote(hub, args.width, args.layers, f"worker-{i}")
            for i in range(args.receivers)
        ]
        ray.get([w.__ray_ready__.remote() for w in workers])
        learner = make_model(args.width, args.layers)

        print(f"transport={args.transport}  receivers={args.receivers}")
        print(f"{'version':>7}  {'receivers':>9}  {'MB':>8}  {'seconds':>8}  {'GB/s':>6}")
        for _ in range(args.broadcasts):
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            report = ray.get(hub.broadcast.remote(learner))
            mb = report.bytes / 1e6
            delivered = report.bytes * len(report.acked) / report.seconds / 1e9
            print(
                f"{report.version:>7}  {len(report.acked):>9}  {mb:>8.1f}  "
                f"{report.seconds:>8.3f}  {delivered:>6.2f}"
            )

        expected = _digest(learner)
        digests = ray.get([w.digest.remote() for w in workers])
        equal = digests == [expected] * len(digests)
        print(f"learner sha256 {expected}; receivers bitwise equal: {equal}")
        for status in ray.get(hub.status.remote()).receivers:
            version, lag = status.versions["model"], status.lag["model"]
            print(f"  {status.worker}: version {version}, lag {lag}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

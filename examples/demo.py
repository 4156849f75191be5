"""`make demo`: every transport that runs here, side by side on the same ~100 MB model
(each that moves buckets also with versions in 16 MiB buckets).

A local Ray cluster; per transport, a hub and 4 receivers, a few broadcasts of the
same model. Prints one row per transport (median seconds per broadcast, GB/s
delivered = MB x receivers / seconds, whether every receiver ended bitwise equal to the
learner, the hub's view of their lag) and writes the same as a bar chart,
``demo_transports.png``. Transports that cannot run here are listed with the reason.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from raysync import WeightHub, WeightReceiver
from raysync.transports import get_transport, known_transports


def make_model(width: int, layers: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


class Worker(WeightReceiver):
    def __init__(self, hub, width: int, layers: int, name: str):
        self.model = make_model(width, layers)
        self.connect_hub(hub, models={"model": "model"}, worker_id=name)

    def digest(self) -> str:
        return _digest(self.model)


#: rdt needs every actor it reaches declared with enable_tensor_transport=True.
_WORKER = ray.remote(num_cpus=0)(Worker)
_RDT_WORKER = ray.remote(num_cpus=0, enable_tensor_transport=True)(Worker)


@dataclass(frozen=True)
class Row:
    transport: str
    seconds: float  #: median per broadcast
    gb_per_s: float  #: bytes x receivers / seconds
    bitwise: bool
    max_lag: int


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()[:16]


def run_transport(transport: str, args: argparse.Namespace, bucket_mb: float | None = None) -> Row:
    """A hub on ``transport``, its receivers, ``args.broadcasts`` broadcasts; then both go.
    With ``bucket_mb``, versions move in buckets of that many MiB."""
    worker_class = _RDT_WORKER if transport == "rdt" else _WORKER
    hub = WeightHub.remote(transport=transport, bucket_mb=bucket_mb)
    workers = [
        worker_class.remote(hub, args.width, args.layers, f"worker-{i}")
        for i in range(args.receivers)
    ]
    try:
        ray.get([w.__ray_ready__.remote() for w in workers])
        learner = make_model(args.width, args.layers)
        seconds, nbytes = [], 0
        for _ in range(args.broadcasts):
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            report = ray.get(hub.broadcast.remote(learner))
            seconds.append(report.seconds)
            nbytes = report.bytes * len(report.acked)
        digests = ray.get([w.digest.remote() for w in workers])
        lags = [s.lag["model"] for s in ray.get(hub.status.remote()).receivers]
        median = statistics.median(seconds)
        return Row(
            transport if bucket_mb is None else f"{transport}+buckets",
            median,
            nbytes / median / 1e9,
            bitwise=digests == [_digest(learner)] * len(workers),
            max_lag=max(lags),
        )
    finally:
        hub.release()
        for actor in [*workers, hub.actor]:
            ray.kill(actor)


def print_table(rows: list[Row], skipped: dict[str, str], args: argparse.Namespace) -> None:
    mb = sum(p.numel() * 4 for p in make_model(args.width, args.layers).parameters()) / 1e6
    print(f"\n{mb:.0f} MB model, {args.receivers} receivers, {args.broadcasts} broadcasts each")
    width = max([len("transport"), *(len(r.transport) for r in rows), *map(len, skipped)])
    print(f"{'transport':<{width}} {'s/broadcast':>11} {'GB/s':>6}  bitwise  max lag")
    for row in rows:
        print(
            f"{row.transport:<{width}} {row.seconds:>11.3f} {row.gb_per_s:>6.2f}  "
            f"{'yes' if row.bitwise else 'NO':<7}  {row.max_lag}"
        )
    for transport, reason in skipped.items():
        print(f"{transport:<{width}} not run: {reason}")


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    names = [r.transport for r in rows]
    axis.bar(names, [r.gb_per_s for r in rows], color="tab:blue")
    axis.set_ylabel("GB/s delivered (median)")
    axis.set_ylim(0, 1.15 * max(r.gb_per_s for r in rows))  # room for the labels
    axis.set_title("raysync transports on this machine: same model, same receivers")
    for index, row in enumerate(rows):
        label = f"{row.seconds * 1e3:.0f} ms"
        axis.annotate(label, (index, row.gb_per_s), ha="center", va="bottom")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--receivers", type=int, default=4)
    parser.add_argument("--broadcasts", type=int, default=5)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6, help="6 x 2048^2 fp32 ~ 100 MB")
    parser.add_argument(
        "--transports", nargs="*", default=None, help="default: every one that runs here"
    )
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=16.0,
        help="each transport that moves buckets also runs with versions in buckets of "
        "this many MiB (0: not)",
    )
    parser.add_argument("--png", type=Path, default=Path("demo_transports.png"))
    args = parser.parse_args()

    ray.init(address="local", num_cpus=max(8, args.receivers + 2), include_dashboard=False)
    try:
        rows, skipped = [], {}
        for transport in args.transports or known_transports():
            availability = get_transport(transport).availability()
            if not availability.available:
                skipped[transport] = availability.reason
                continue
            print(f"{transport} ...", flush=True)
            rows.append(run_transport(transport, args))
            if get_transport(transport).buckets and args.bucket_mb > 0:
                print(f"{transport}, {args.bucket_mb:g} MiB buckets ...", flush=True)
                rows.append(run_transport(transport, args, bucket_mb=args.bucket_mb))
        print_table(rows, skipped, args)
        plot(rows, args.png)
        print(f"chart: {args.png.resolve()}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

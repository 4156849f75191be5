"""Bucketed versions (``bucket_mb``) against whole versions: memory and time by model size.

For each (size, mode) cell, a fresh hub on ``--transport`` (``object_store``; ``rpc``
or ``distributed``, whose agent / rank 0 relays each bucket; ``shared_memory``;
``nixl`` and ``rdt``, whose learner streams buckets from two registered slots) and N
receiver actors (the
mixin, one float32 state_dict of 16 tensors) take one untimed and ``--repeats`` timed
broadcasts from this process (the learner). Modes: ``whole`` (one put per version), ``bucketed``
(``bucket_mb``), ``bucketed_bf16`` (also ``wire_dtype=bfloat16``). Recorded per cell:

* the seconds of each broadcast, until every receiver applied it (p50, and per GB);
* the peak growth of private resident memory (``RssAnon``, sampled every 5 ms in each
  process) from before the first broadcast to after the last — the learner (this
  process), each receiver (its staging buffers included), the hub, the bucket broker
  (from its start, during the first broadcast), the relay: what a process holds
  beyond the model (the object store's shared pages it maps are the store's, below);
* the object store's peak bytes pinned as primary copies (what it must hold) and peak
  bytes in use (also objects every reference has left, which the raylet deletes in
  batches, every second by default, and evicts sooner when space is needed), sampled
  every 20 ms through the raylet, and bytes spilled to disk;
* that the last version arrived bit for bit in every receiver (a blake2b of each
  receiver's tensors against the learner's, cast through bfloat16 for that mode);
* for a bucketed cell, where the time between the last broadcast's buckets went, from
  the bucket broker's clock (:class:`raysync.transports.hand_off.HandOff`: per bucket,
  the period, the readers' and the learner's turns, medians in ms).

With ``--device cuda`` the learner's weights and each receiver's model live in VRAM
(receivers share the GPU: ``num_gpus`` 0.1 each); the learner's peak of CUDA memory
allocated beyond its weights is recorded too.

``python benchmarks/buckets.py --sizes 256 512 1024 2048 4096 --out
benchmarks/results/buckets.json`` (sizes in MiB; JSON + PNG). A model larger than the
object store: ``--object-store-mb 1024 --sizes 3072 --modes bucketed --receivers 2``.
On ``rpc``: ``--transport rpc --sizes 1024 --out benchmarks/results/buckets_rpc.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import hashlib
import json
import signal
import statistics
import threading
import time
from pathlib import Path

import ray
import torch
from ray._private.internal_api import get_memory_info_reply, get_state_from_address

from raysync import WeightHub, WeightReceiver
from raysync.transports.distributed import process_group_name
from raysync.transports.object_store.bucket_stream import BROKER_NAMESPACE, broker_name
from raysync.transports.rpc import agent_name

_MODEL = "m"
_TENSORS = 16
MODES = ("whole", "bucketed", "bucketed_bf16")


def _state(size_mb: int, value: float, device: str = "cpu") -> dict[str, torch.Tensor]:
    per = size_mb * 2**20 // 4 // _TENSORS
    generator = torch.Generator().manual_seed(int(value))
    return {
        f"w{i:02d}": torch.randn(per, generator=generator).add_(value).to(device)
        for i in range(_TENSORS)
    }


def _zeros(size_mb: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A receiver's model, allocated as is (no freed heap left behind for the staging
    buffers to reuse unseen)."""
    per = size_mb * 2**20 // 4 // _TENSORS
    return {f"w{i:02d}": torch.zeros(per, device=device) for i in range(_TENSORS)}


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        h.update(tensors[name].contiguous().cpu().view(torch.uint8).numpy())
    return h.hexdigest()


def _rss_anon_kb() -> int:
    """This process's private (anonymous) resident memory, KiB: its heap and tensors,
    not the object store's shared pages it maps (those count in VmRSS too)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon"))


class _AnonPeak:
    """Samples this process's RssAnon every 5 ms in a thread: its peak since ``reset``."""

    def __init__(self) -> None:
        self.base = self.peak = _rss_anon_kb()
        threading.Thread(target=self._run, daemon=True).start()

    def reset(self) -> None:
        self.base = self.peak = _rss_anon_kb()

    def growth_mb(self) -> float:
        return (max(self.peak, _rss_anon_kb()) - self.base) / 1024

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, _rss_anon_kb())
            time.sleep(0.005)


def _sample(actor) -> None:  # through __ray_call__: actor is the actor instance
    """Start (or reset) the sampler in the actor's process."""
    sampler = getattr(actor, "_bench_anon_peak", None)
    if sampler is None:
        actor._bench_anon_peak = _AnonPeak()
    else:
        sampler.reset()


def _growth(actor) -> float:
    return actor._bench_anon_peak.growth_mb()


class _Receiver(WeightReceiver):
    def __init__(self, hub, size_mb: int, device: str = "cpu"):
        self.weights = _zeros(size_mb, device)
        self.connect_hub(hub, {_MODEL: "weights"})

    def digest(self) -> str:
        return _digest(self.weights)


#: The receiver actor per transport (``rdt`` needs Ray's tensor transport declared).
_RECEIVERS = {
    "rdt": ray.remote(num_cpus=0, enable_tensor_transport=True)(_Receiver),
}
_PLAIN_RECEIVER = ray.remote(num_cpus=0)(_Receiver)


class _StoreWatch:
    """The object store's peak bytes in use and pinned while it runs (a thread polling the
    raylet): the whole store's, so a cell starts once the previous cells' objects are
    gone (:meth:`wait_empty`)."""

    def __init__(self, address: str) -> None:
        self._state = get_state_from_address(address)
        self.peak = self.pinned_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def stats(self):
        return get_memory_info_reply(self._state).store_stats

    def wait_empty(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.stats().object_store_bytes_used and time.monotonic() < deadline:
            time.sleep(0.1)

    def _run(self) -> None:
        while not self._stop.is_set():
            stats = self.stats()
            self.peak = max(self.peak, stats.object_store_bytes_used)
            self.pinned_peak = max(self.pinned_peak, stats.object_store_bytes_primary_copy)
            self._stop.wait(0.02)

    def __enter__(self) -> _StoreWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _relays(transport: str, hub_id: str) -> dict:
    """The actor that relays a bucketed version to the receivers of ``transport``."""
    if transport == "rpc":
        return {"agent": ray.get_actor(agent_name(hub_id))}
    if transport == "distributed":
        return {"rank0": ray.get_actor(process_group_name(hub_id))}
    return {}


def run_cell(size_mb: int, mode: str, args: argparse.Namespace, address: str) -> dict:
    bucket_mb = None if mode == "whole" else args.bucket_mb
    wire = torch.bfloat16 if mode.endswith("bf16") else None
    _StoreWatch(address).wait_empty()
    hub = WeightHub.remote(models=[_MODEL], timeout_s=args.timeout_s, transport=args.transport)
    receiver_class = _RECEIVERS.get(args.transport, _PLAIN_RECEIVER)
    if args.device == "cuda":
        receiver_class = receiver_class.options(num_gpus=0.1)
    receivers = [receiver_class.remote(hub, size_mb, args.device) for _ in range(args.receivers)]
    ray.get([r.__ray_ready__.remote() for r in receivers])
    weights = _state(size_mb, 1.0, args.device)
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_base = torch.cuda.memory_allocated()
    seconds, broker = [], None
    try:
        # Memory is watched from before the first broadcast (it allocates the receivers'
        # staging buffers, kept for the next ones); that one is not timed (it also
        # starts the broker and opens the senders).
        learner = _AnonPeak()
        relays = _relays(args.transport, hub.config.hub_id)
        watched = [*receivers, hub.actor, *relays.values()]
        ray.get([a.__ray_call__.remote(_sample) for a in watched])
        spilled_before = _StoreWatch(address).stats().spilled_bytes_total
        with _StoreWatch(address) as store:  # the whole store: the previous cell's is gone
            for repeat in range(args.repeats + 1):
                for t in weights.values():
                    t.add_(1.0)
                started = time.perf_counter()
                ray.get(
                    hub.broadcast.remote(weights, bucket_mb=bucket_mb, wire_dtype=wire),
                    timeout=args.timeout_s,
                )
                elapsed = time.perf_counter() - started
                if args.progress:
                    print(f"  broadcast {repeat}: {elapsed:.3f} s", flush=True)
                if repeat:
                    seconds.append(elapsed)
                elif bucket_mb is not None and bucket_mb < size_mb:
                    name = broker_name(hub.config.hub_id)
                    broker = ray.get_actor(name, namespace=BROKER_NAMESPACE)
                    ray.get(broker.__ray_call__.remote(_sample))
        processes = {"hub": hub.actor, **relays} | ({"broker": broker} if broker else {})
        spilled = store.stats().spilled_bytes_total - spilled_before
        growth = {
            "learner": learner.growth_mb(),
            "receivers": max(ray.get([r.__ray_call__.remote(_growth) for r in receivers])),
        }
        for name, actor in processes.items():
            growth[name] = ray.get(actor.__ray_call__.remote(_growth))
        expected = weights if wire is None else {k: v.to(wire).float() for k, v in weights.items()}
        bitwise = set(ray.get([r.digest.remote() for r in receivers])) == {_digest(expected)}
        if args.device == "cuda":
            growth["learner_cuda"] = (torch.cuda.max_memory_allocated() - cuda_base) / 2**20
        p50 = statistics.median(seconds)
        hand_off = None if broker is None else ray.get(broker.hand_off.remote())
        return {
            "size_mb": size_mb,
            "device": args.device,
            "transport": args.transport,
            "mode": mode,
            "bucket_mb": bucket_mb,
            "receivers": args.receivers,
            "seconds": seconds,
            "p50_s": p50,
            "s_per_gb": p50 / (size_mb / 1024),
            "peak_growth_mb": growth,
            "store_peak_mb": store.peak / 2**20,
            "store_pinned_peak_mb": store.pinned_peak / 2**20,
            "spilled_mb": spilled / 2**20,
            "bitwise": bitwise,
            "hand_off": None if hand_off is None else dataclasses.asdict(hand_off),
        }
    finally:
        ray.get(hub.close.remote())
        for r in receivers:
            ray.kill(r)
        ray.kill(hub.actor)
        if broker is not None:
            ray.kill(broker)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"whole": "--", "bucketed": "-", "bucketed_bf16": ":"}
    for mode in MODES:
        cells = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["size_mb"])
        if not cells:
            continue
        sizes = [c["size_mb"] / 1024 for c in cells]
        for what, color in (("learner", "C0"), ("receivers", "C1")):
            mem.plot(
                sizes,
                [c["peak_growth_mb"][what] / 1024 for c in cells],
                styles[mode],
                color=color,
                marker="o",
                label=f"{what} ({mode})",
            )
        mem.plot(
            sizes,
            [c["store_pinned_peak_mb"] / 1024 for c in cells],
            styles[mode],
            color="C2",
            marker="s",
            label=f"object store, pinned ({mode})",
        )
        speed.plot(sizes, [c["s_per_gb"] for c in cells], styles[mode], marker="o", label=mode)
    mem.set(
        xlabel="model size (GiB)",
        ylabel="peak growth during broadcasts (GiB)",
        title="Memory beyond the model, by process",
    )
    speed.set(xlabel="model size (GiB)", ylabel="seconds per GiB (p50)", title="Time per GiB")
    mem.legend(fontsize=7)
    speed.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--whole-max-mb", type=int, default=2048, help="largest whole-version cell")
    p.add_argument("--receivers", type=int, default=1)
    p.add_argument(
        "--transport",
        choices=("object_store", "shared_memory", "rpc", "distributed", "nixl", "rdt"),
        default="object_store",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--object-store-mb", type=int, default=10 * 1024)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/buckets.json"))
    p.add_argument("--progress", action="store_true", help="print each broadcast's time")
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: every thread's stack

    ray.init(
        num_cpus=16,
        include_dashboard=False,
        object_store_memory=args.object_store_mb * 2**20,
        log_to_driver=False,
    )
    address = ray.get_runtime_context().gcs_address
    rows = []
    try:
        for size in args.sizes:
            for mode in args.modes:
                if mode == "whole" and size > args.whole_max_mb:
                    continue
                row = run_cell(size, mode, args, address)
                rows.append(row)
                print(
                    f"{size:5d} MiB {mode:14s} p50 {row['p50_s']:.2f} s "
                    f"({row['s_per_gb']:.2f} s/GiB)  growth MiB: "
                    + ", ".join(f"{k} {v:.0f}" for k, v in row["peak_growth_mb"].items())
                    + f"; store pinned {row['store_pinned_peak_mb']:.0f} MiB, in use "
                    f"{row['store_peak_mb']:.0f} MiB, spilled "
                    f"{row['spilled_mb']:.0f} MiB, bitwise {row['bitwise']}",
                    flush=True,
                )
                if row["hand_off"]:
                    print(
                        "      per bucket (ms, last broadcast's median): "
                        + ", ".join(
                            f"{k.removesuffix('_s')} {v * 1e3:.1f}"
                            for k, v in row["hand_off"].items()
                            if k != "buckets"
                        )
                        + f"; {row['hand_off']['buckets']} buckets",
                        flush=True,
                    )
    finally:
        ray.shutdown()
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": meta, "rows": rows}, indent=1))
    plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()

"""The receiver actor a cell starts N of: a raysync ``WeightReceiver`` holding one
preallocated model, which also runs the receiver halves of the floors."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import ray
import torch

from broadcast_bench.floors import (
    RawReader,
    RawSource,
    apply_put_by_hand,
    post_raw_read,
    prepare_raw_read,
)
from broadcast_bench.model import Layout
from broadcast_bench.units import DTYPE
from raysync import WeightReceiver


class _BenchReceiver(WeightReceiver):
    """Holds one preallocated model; raysync applies into it, and so does ``apply_baseline``.
    In nixl cells it also hosts a raw NIXL reader (an agent of its own, used only there).
    It connects to the hub only when told (``connect``), after the floors are timed."""

    def __init__(self, spec: Layout, threads: int) -> None:
        torch.set_num_threads(threads)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        # The model: views of one flat buffer (every page touched), so that the raw READ
        # can land in the very memory the broadcast writes, with no buffer of its own.
        self.flat = torch.empty(sum(numel for _, numel in spec), dtype=DTYPE).fill_(0.0)
        self.model = dict(
            zip(
                [name for name, _ in spec],
                self.flat.split([numel for _, numel in spec]),
                strict=True,
            )
        )
        self.raw: RawReader | None = None

    def connect(self, hub: Any, options: dict[str, Any]) -> None:
        self.connect_hub(hub, models={"m": "model"}, **options)

    def ready(self) -> str:
        """Where this worker imported raysync from (must be where the learner did)."""
        import raysync

        return str(Path(raysync.__file__).parent)

    def apply_baseline(self, refs: list[Any]) -> int:
        """The hand-written receiver: get the put arrays, copy them in place."""
        return apply_put_by_hand(self.model, refs)

    def probe(self) -> list[float]:
        return [float(t[0]) for t in self.model.values()]

    def raw_setup(self, source: RawSource) -> None:
        """Prepare the raw READ of ``source`` into the model's flat buffer."""
        self.raw = prepare_raw_read(self.flat, source)

    def raw_read(self) -> tuple[float, float]:
        """Post the prepared READ and poll it until done: when (``perf_counter``) and
        element 0 (the source's tag)."""
        return post_raw_read(self.raw, self.flat)


BenchReceiver = ray.remote(num_cpus=0)(_BenchReceiver)


# Ray reads enable_tensor_transport from the class decorator only (not .options()); the
# rdt transport needs it on every receiver. The other transports run without it.
@ray.remote(num_cpus=0, enable_tensor_transport=True)
class RdtBenchReceiver(_BenchReceiver):
    pass


def receiver_class(transport: str) -> Any:
    """The actor class a cell of ``transport`` starts its receivers from."""
    return RdtBenchReceiver if transport == "rdt" else BenchReceiver

"""The synthetic model a cell broadcasts: its layout, fresh tensors, the version tag each
timed run writes, and the check that a version landed on every receiver."""

from __future__ import annotations

import torch

from broadcast_bench.units import DTYPE

#: (name, numel) of each tensor, in order.
Layout = list[tuple[str, int]]


def layout(size_bytes: int, n_tensors: int) -> Layout:
    """``n_tensors`` float32 tensors (name, numel) adding up to exactly ``size_bytes``."""
    numel = size_bytes // DTYPE.itemsize
    if n_tensors > numel:
        raise ValueError(f"cannot split {size_bytes} bytes into {n_tensors} tensors")
    base, extra = divmod(numel, n_tensors)
    return [(f"layer{i:04d}.weight", base + (1 if i < extra else 0)) for i in range(n_tensors)]


def make_state_dict(spec: Layout, fill: float) -> dict[str, torch.Tensor]:
    """Freshly allocated tensors, every page touched (no first-touch faults in the timing)."""
    return {name: torch.empty(numel, dtype=DTYPE).fill_(fill) for name, numel in spec}


def tag(weights: dict[str, torch.Tensor], value: int) -> None:
    """Mark one version: element 0 of every tensor (cheap; checked on every receiver)."""
    for tensor in weights.values():
        tensor[0] = value


def check_landed(values: list[list[float]], value: int, method: str) -> None:
    """Every receiver's probe (element 0 of each tensor) shows version tag ``value``."""
    for probe in values:
        if any(v != value for v in probe):
            bad = sorted(set(probe) - {value})[:3]
            raise RuntimeError(f"{method}: a receiver holds {bad}, expected version tag {value}")

"""Sizes: the models' dtype, ``64MB``-style size arguments and sizes as printed."""

from __future__ import annotations

import argparse

import torch

#: Every benchmark model is float32.
DTYPE = torch.float32
MiB = 2**20
GiB = 2**30
_UNITS = {"B": 1, "KB": 2**10, "MB": MiB, "GB": GiB}


def parse_size(text: str) -> int:
    """``"64MB"`` -> 67108864 (powers of 1024); a plain number is bytes."""
    t = text.strip().upper().replace("IB", "B").replace(" ", "")
    for unit in ("KB", "MB", "GB", "B"):
        if t.endswith(unit):
            value = float(t[: -len(unit)]) * _UNITS[unit]
            break
    else:
        value = float(t)
    size = int(value)
    if size <= 0 or size % DTYPE.itemsize:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return size


def fmt_size(nbytes: int) -> str:
    """``"1 GB"`` for whole GiB, else MiB: ``"64 MB"``, ``"0.5 MB"``."""
    if nbytes >= GiB and nbytes % GiB == 0:
        return f"{nbytes // GiB} GB"
    return f"{nbytes / MiB:g} MB"

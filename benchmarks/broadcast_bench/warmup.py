"""How long a benchmark's untimed broadcasts go on before it times any: a count, and a
time. Ray's raylet deletes unused objects once a second, so a learner that broadcasts
in a loop puts on store pages it never touched until it has put for about that long
(docs/latency.md, "Why a tight loop stays cold"); the count covers what warms up by
number (Ray's compiled graphs run their first ~10 executions slower). The time does not
always suffice: right after another scheme's series of large updates a series can stay
cold throughout (docs/benchmarks.md, "Large models beside TorchRL's scheme")."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

#: Seconds of untimed broadcasts by default: past Ray's once-a-second object deletion.
DEFAULT_SECONDS = 2.0


@dataclass(frozen=True)
class WarmUp:
    """``count`` untimed broadcasts at least, lasting ``seconds`` at least, from when
    this value is made (make one per series)."""

    count: int
    seconds: float
    _until: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_until", time.monotonic() + self.seconds)

    def over(self, done: int) -> bool:
        """Whether, with ``done`` untimed broadcasts behind it, the series may be timed."""
        return done >= self.count and time.monotonic() >= self._until


def add_seconds_argument(parser: argparse.ArgumentParser) -> None:
    """``--warmup-s``: the untimed broadcasts' least duration (after ``--warmup`` of them)."""
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=DEFAULT_SECONDS,
        help="untimed broadcasts go on at least this long (after --warmup of them)",
    )

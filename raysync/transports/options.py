"""Typed settings of the transports that have any: ``WeightHub.remote(options=...)``.

Plain frozen dataclasses with no heavy import. The learner builds them, the hub's
config carries them to the hub process, whose planner of that transport reads its own
(:attr:`raysync.transports.HubContext.options`) and hands it to its resource actor and
receivers in its messages. A transport without an options class takes none.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

#: Backends of the ``distributed`` transport.
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class DistributedOptions:
    """Settings of the ``distributed`` transport (torch.distributed collectives)."""

    #: ``gloo`` (CPU buffers) or ``nccl`` (CUDA buffers; rank 0 asks Ray for one GPU,
    #: every receiver needs its own GPU).
    backend: str = "gloo"
    #: Timeout of every rendezvous and collective. Keep it below the broadcast timeout:
    #: a member that does not enter a collective holds the others for this long.
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"DistributedOptions.backend={self.backend!r}: expected one of "
                f"{', '.join(BACKENDS)}"
            )
        _check_seconds("DistributedOptions.timeout_s", self.timeout_s)

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)


@dataclass(frozen=True)
class RpcOptions:
    """Settings of the ``rpc`` transport (torch.distributed.rpc over TensorPipe)."""

    #: Timeout of the rendezvous, of every RPC and of a receiver's wait in ``fetch``.
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _check_seconds("RpcOptions.timeout_s", self.timeout_s)


#: The shortest timeout: torch keeps whole milliseconds and reads 0 ms as *no* timeout
#: (c10d's kNoTimeout), so a shorter one would make store waits and barriers unbounded.
MIN_TIMEOUT_S = 0.001
#: The longest: what ``datetime.timedelta`` holds (the transports build one from it).
MAX_TIMEOUT_S = float(datetime.timedelta.max.days * 86400)


def _check_seconds(what: str, seconds: object) -> None:
    """ValueError naming field ``what`` unless ``seconds`` is a number (no bool) of
    seconds from :data:`MIN_TIMEOUT_S` to :data:`MAX_TIMEOUT_S` (so neither NaN nor
    infinity). (This mirrors ``raysync.hub_handle.check_seconds``, which this package
    cannot import: ``hub_handle`` imports ``raysync.transports``.)"""
    if isinstance(seconds, bool) or not (
        isinstance(seconds, int | float) and MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S
    ):
        raise ValueError(
            f"{what} must be a finite number of seconds of at least {MIN_TIMEOUT_S:g} "
            f"(torch reads less than a millisecond as no timeout), got {seconds!r}"
        )

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
        _check_positive("DistributedOptions.timeout_s", self.timeout_s)

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)


@dataclass(frozen=True)
class RpcOptions:
    """Settings of the ``rpc`` transport (torch.distributed.rpc over TensorPipe)."""

    #: Timeout of the rendezvous, of every RPC and of a receiver's wait in ``fetch``.
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _check_positive("RpcOptions.timeout_s", self.timeout_s)


def _check_positive(what: str, seconds: float) -> None:
    if not seconds > 0:
        raise ValueError(f"{what} must be positive, got {seconds!r}")

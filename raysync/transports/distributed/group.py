"""Receiver processes and the rank-0 actor: joining a generation and its broadcasts."""

from __future__ import annotations

from typing import Any

import torch

from raysync.transports.distributed.wire import Generation
from raysync.transports.options import DistributedOptions
from raysync.transports.process_groups import node_ip


def join_group(
    generation: Generation,
    rank: int,
    store: torch.distributed.Store | None = None,
) -> Any:
    """This process's member object of ``generation`` (rendezvous plus a barrier).

    ``store`` is the master store (rank 0); other ranks connect to the generation's
    address. Returns once every member has joined, so the rendezvous keys are no
    longer needed; raises on timeout.
    """
    import torch.distributed as dist

    settings = generation.settings
    if store is None:
        store = dist.TCPStore(
            generation.store.host,
            generation.store.port,
            is_master=False,
            timeout=settings.timeout,
        )
    prefixed = dist.PrefixStore(generation.prefix, store)
    if settings.backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = settings.timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=node_ip())]
        group = dist.ProcessGroupGloo(prefixed, rank, generation.world_size, options)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = settings.timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, generation.world_size, options)
    barrier = group.barrier()
    barrier.wait(settings.timeout)
    return group


def run_broadcast(group: Any, buffer: torch.Tensor, settings: DistributedOptions) -> None:
    """Broadcast ``buffer`` from rank 0 (every member calls this); raises on failure."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.timeout = settings.timeout
    group.broadcast([buffer], options).wait(settings.timeout)
    if buffer.device.type == "cuda":
        torch.cuda.current_stream(buffer.device).synchronize()


def staging_device(settings: DistributedOptions) -> torch.device:
    if settings.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""Zero-copy adoption: a receiver's model takes a staged version as its own memory.

Everything here runs in the receiver actor's process, at the safe point, called by
:class:`raysync.receiver_core.ReceiverCore` when it applies a version to a model of a
``zero_copy`` receiver. Instead of copying the staged tensors a transport fetched into
the model, each of the model's tensors is pointed at them (``tensor.data = view``): the
same Python objects, so optimizers and hooks keep theirs, with new storage. The staged
version stays the model's memory until a newer one replaces it; only then is it handed
back to its transport (``TransportReceiver.release``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from raysync import weights
from raysync.transports import TransportReceiver

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdoptedVersion:
    """The staged version a zero-copy model's tensors live in; handed back to its
    transport once the model moves on to a newer one. ``transport`` None: tensors of
    the receiver's own (a version cast on the wire), nothing to hand back."""

    transport: TransportReceiver | None
    payload: Any
    staged: Sequence[torch.Tensor]
    version: int = 0  #: the model's version it holds (for the log)

    def release(self) -> None:
        """Hand the version back; a transport that fails to is logged (the model
        moved on all the same: an ack, and the core's books, say where it is now)."""
        if self.transport is None:
            return
        try:
            _wait_for_kernels(self.staged)
            self.transport.release(self.payload, self.staged)
        except Exception:
            logger.exception("could not hand version %d back to its transport", self.version)


def _wait_for_kernels(staged: Sequence[torch.Tensor]) -> None:
    """Return once every kernel queued on the CUDA devices of ``staged`` has run: the
    model lived in that memory until now, and the host's last forward pass may still be
    reading it on any of its streams; handed back, it may be written again at once by
    DMA (a NIXL READ), which waits for no stream. (On a CPU, nothing to wait for.)"""
    for device in {tensor.device for tensor in staged if tensor.is_cuda}:
        torch.cuda.synchronize(device)


def rebind(model: Any, names: tuple[str, ...], staged: Sequence[torch.Tensor]) -> str | None:
    """Point each of ``model``'s tensors named ``names`` at the staged view of the same
    position. None once done; else why it cannot be done, with nothing changed."""
    own = weights.own_tensors(model, names)
    if own is None:
        return "its tensors are reached only by copying"
    pairs = [(own[name], view) for name, view in zip(names, staged, strict=True)]
    for name, (tensor, view) in zip(names, pairs, strict=True):
        if tensor.device != view.device:
            return f"{name!r} is on {tensor.device}, the staged data on {view.device}"
        if tensor.is_inference():  # its ``.data`` cannot be set (torch raises)
            return f"{name!r} is an inference tensor (made under torch.inference_mode())"
    with torch.no_grad():
        for tensor, view in pairs:
            tensor.data = view
    return None


@dataclass
class Adoption:
    """One model's zero-copy state: the staged version it lives in, if any, and
    whether it fell back to being copied into (logged once per model)."""

    current: AdoptedVersion | None = None
    copies_instead: bool = False
    #: The names of the model's tensors, in the order of ``current.staged``.
    names: tuple[str, ...] = ()

    def take(
        self,
        model: Any,
        names: tuple[str, ...],
        version: AdoptedVersion,
        *,
        actor: str,
        model_id: str,
    ) -> bool:
        """Make ``version`` the memory of ``model``'s tensors and release the version
        they leave. False when a tensor cannot be rebound: the model is then copied into
        as usual (a warning naming ``actor`` and ``model_id`` says why, once per model),
        so its tensors still in the version it was living in get memory of their own
        first (the same values) and that version is handed back: a transport's memory
        is read-only, shared with other receivers or written again with later versions.
        (The host may have moved the model, all of it or a part, or built it anew.)"""
        refusal = rebind(model, names, version.staged)
        if refusal is not None:
            current = self.current
            if current is not None:  # kept until the model is out of it (a clone may fail)
                _move_out(model, self.names, current.staged)
                self.current = None
                current.release()
            if not self.copies_instead:
                self.copies_instead = True
                logger.warning(
                    "%s: zero_copy is off for model %r (%s); its updates are copied",
                    actor,
                    model_id,
                    refusal,
                )
            return False
        previous, self.current = self.current, version
        self.names = names
        if previous is not None:
            previous.release()
        return True

    def keep_privately(self, model: Any) -> None:
        """Move ``model`` out of the transport's memory it lives in into a copy of its
        own (the same values), and hand that memory back: once its receiver leaves the
        hub, nothing holds it for the model (a shared-memory slot would be written with
        later versions under it). Nothing to do for a model in memory of its own. Only
        the tensors still in that memory are copied: the host may have moved or cast
        others since, and they stay as it left them."""
        current = self.current
        if current is None or current.transport is None:
            return
        _move_out(model, self.names, current.staged)
        self.current = None
        current.release()

    def let_go(self) -> None:
        """Hand the memory the model lived in back without moving anything out: the
        host no longer holds the model there."""
        current, self.current = self.current, None
        if current is not None:
            current.release()

    def lives_in(self, staged: Sequence[torch.Tensor]) -> bool:
        """Whether the model's tensors are ``staged`` (so it must not be released)."""
        return self.current is not None and self.current.staged is staged


def _move_out(model: Any, names: tuple[str, ...], staged: Sequence[torch.Tensor]) -> None:
    """Give each of ``model``'s tensors named ``names`` that is still one of the
    ``staged`` views it was rebound to a copy of its own (the same values)."""
    with torch.no_grad():
        for tensor in _still_in(model, names, staged):
            tensor.data = tensor.data.clone()


def _still_in(
    model: Any, names: tuple[str, ...], staged: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Those of ``model``'s tensors named ``names`` that are still one of the ``staged``
    views they were rebound to (the host may have moved them, or built it anew)."""
    own = weights.own_tensors(model, names)
    if own is None:
        return []
    views = {view.data_ptr() for view in staged if view.numel()}
    return [t for t in own.values() if t.numel() and t.data_ptr() in views]

"""TorchRL's weight-sync scheme backed by raysync: :class:`RaySyncScheme`.

Install with ``pip install raysync[torchrl]``; nothing else in raysync imports this module.
Hand the scheme to TorchRL's ``RayCollector``::

    collector = RayCollector(..., weight_sync_schemes={"policy": RaySyncScheme()})
    collector.update_policy_weights_()   # every remote collector acts with them from its next batch

TorchRL drives the scheme through its ``WeightSyncScheme`` hooks, in this order:

1. ``init_on_sender`` — in the process that builds the ``RayCollector`` (the learner),
   once its remote collectors exist: the scheme starts its hub (or looks up the one it
   was given) and names each remote collector's receiver.
2. ``init_on_receiver`` — in each remote collector's actor, when TorchRL hands it the
   pickled scheme (``register_scheme_receiver``): the collector's model is attached to
   the hub with :func:`raysync.attach` in push mode, so the hub delivers every version
   between two calls of the collector (a collection never mixes two versions).
3. ``connect`` — on both sides at the first ``update_policy_weights_()``: nothing to set
   up, the receivers registered in step 2 (``connect(weights=w)`` on the learner
   broadcasts ``w``).
4. ``send`` — in the learner, for each ``update_policy_weights_()``: one
   ``hub.broadcast`` to every receiver of the model at the hub (or the ``worker_ids``
   asked for), waited for until every one applied it. Each receiver then passes the
   update on to its own sub-collectors (``MultiSyncCollector``/``MultiAsyncCollector``
   workers) the way TorchRL's schemes do, through the collector's
   ``update_policy_weights_`` (a ``MultiAsyncCollector``'s workers, collecting
   meanwhile, may mix two versions in a batch under way, as with TorchRL's schemes).
5. ``shutdown`` — in the learner, from ``RayCollector.shutdown()``: a hub the scheme
   started is closed; a hub it was given drops the collectors TorchRL has just ended.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import ray
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.weight_update.weight_sync_schemes import (
    WeightSyncScheme,
    register_weight_sync_backend,
)

from raysync.attached import attach
from raysync.errors import BroadcastError, UnknownWorkerError
from raysync.hub_handle import DEFAULT_TIMEOUT_S, HubHandle, check_seconds
from raysync.hub_launch import WeightHub, get_hub
from raysync.messages import BroadcastReport
from raysync.model_path import resolve
from raysync.transports import DEFAULT_TRANSPORT

logger = logging.getLogger(__name__)

#: Seconds between tries of an update while Ray restarts the hub, or until it knows the
#: collectors again.
_REGISTERED_AGAIN_LOOK_S = 0.5
#: Seconds a remote collector has to answer whether it lives, when the hub does not
#: know it (one that does not answer in time is busy, not dead).
_ALIVE_LOOK_S = 1.0


@register_weight_sync_backend("raysync")
class RaySyncScheme(WeightSyncScheme):
    """Keeps one model of TorchRL's remote collectors in sync through a raysync hub.

    ``hub`` is a :class:`~raysync.HubHandle` or a named hub's name (looked up in
    ``namespace``); without one, ``init_on_sender`` starts a hub of the scheme's own,
    closed again by :meth:`shutdown`. ``transport`` is that hub's transport; with a hub
    given, it is the one the collectors read by (overriding the hub's for them).
    ``timeout_s`` bounds each ``update_policy_weights_()`` (every collector's ack) and
    every wait on the hub. ``model`` is the model's id at the hub (default: TorchRL's id
    for it, the key of ``weight_sync_schemes``, e.g. ``"policy"``): every receiver of that
    id on the hub shares its versions (an evaluator actor attached to ``"policy"`` gets
    each update too, and a collector that joins later gets the latest, whoever sent it),
    so two RayCollectors on one given hub need a ``model`` each. Registered with TorchRL
    as backend ``"raysync"`` when this module is imported, so ``import raysync.torchrl``
    must run first in the process that calls
    ``WeightSyncScheme.from_backend("raysync", hub=...)`` (in a fresh process it raises
    ``ValueError``).

    After :meth:`send`, :attr:`last_report` holds that broadcast's
    :class:`~raysync.BroadcastReport` (its ``version``, who acked, where the time went),
    a failed one's too (who applied it, why the others did not).

    A version lands in a remote collector between two of its calls (``next`` is one
    batch): RayCollector's collectors are default actors, one call at a time. With
    ``remote_configs={"max_concurrency": n}`` (n > 1) a version could land inside a
    batch. Weights move as TorchRL's ``"tensordict"`` strategy has them
    (``TensorDict.from_module``), but for buffers a module does not save
    (``persistent=False``), which stay each process's own as everywhere in raysync;
    a learner module with extra state (TorchRL then adds
    ``__extra_state__`` keys) is refused with a SpecMismatchError naming them.
    """

    def __init__(
        self,
        hub: HubHandle | str | None = None,
        *,
        transport: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        namespace: str | None = None,
        model: str | None = None,
    ) -> None:
        super().__init__(strategy="tensordict")
        check_seconds("timeout_s", timeout_s)
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"model must be a non-empty model id, got {model!r}")
        self._hub_model_given = model
        self._hub_given = hub
        self._namespace = namespace
        self._transport = transport
        self._timeout_s = timeout_s
        self._hub: HubHandle | None = None
        self._owns_hub = False
        self._workers: tuple[str, ...] = ()
        self._collectors: tuple[Any, ...] = ()  # the learner's handles, by index
        self._receiver: Any = None
        self.last_report: BroadcastReport | None = None

    # -- the learner's side ----------------------------------------------------------------
    def _init_on_sender_impl(
        self,
        model_id: str,
        context: Any = None,
        *,
        remote_collectors: Sequence[Any] | None = None,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        """In the learner: find the remote collectors, name their receivers, get the hub."""
        if remote_collectors is None and context is not None:
            remote_collectors = getattr(context, "remote_collectors", None)
        if not remote_collectors:
            raise ValueError(
                f"RaySyncScheme for model {model_id!r} needs the remote collectors "
                "(remote_collectors=, or a RayCollector as context)"
            )
        if self._owns_hub:  # run again (a RayCollector built anew with this scheme)
            self._close_own_hub()
        self.model_id = model_id
        self.context = context
        self.model = model
        self._collectors = tuple(remote_collectors)
        scheme_id = uuid.uuid4().hex[:8]
        self._workers = tuple(
            _worker_id(scheme_id, model_id, index) for index in range(len(remote_collectors))
        )
        self._hub, self._owns_hub = self._open_hub(self.hub_model)

    def _open_hub(self, model_id: str) -> tuple[HubHandle, bool]:
        given = self._hub_given
        if isinstance(given, HubHandle):
            return given, False
        if isinstance(given, str):
            return get_hub(given, self._namespace, timeout_s=self._timeout_s), False
        hub = WeightHub.remote(
            transport=self._transport or DEFAULT_TRANSPORT,
            timeout_s=self._timeout_s,
            models=[model_id],
        )
        return hub, True

    def connect(self, *, worker_idx: int | None = None, weights: Any | None = None) -> None:
        """TorchRL's ``connect``, which may come again here. A RayCollector whose first
        update failed (its set-up cascade fails on a collector Ray restarted before it,
        which holds no receiver of this scheme) runs its whole weight-sync set-up again
        at the next update, as does a RayCollector handed a scheme another one used;
        TorchRL refuses a scheme that connected once ("Cannot synchronize weights on
        sender twice"), and the collectors were never updated again. Connecting moves
        nothing here but initial weights, so each connect is one more of the same."""
        self.synchronized_on_sender = self.synchronized_on_receiver = False
        super().connect(worker_idx=worker_idx, weights=weights)

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: int | None = None, weights: Any = None
    ) -> None:
        """``connect()`` in the learner (the RayCollector's first update): the receivers
        registered in ``init_on_receiver``; a collector Ray restarted since holds none,
        and is handed this scheme again (so that the set-up, made again at the next
        update, finds it there); initial ``weights``, if given, are broadcast."""
        self._attach_restarted(self._workers, time.monotonic() + self._timeout_s)
        if weights is not None:
            self.send(weights)

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Broadcast ``weights`` (default: the learner's model) and wait for the acks.

        Called in the learner by ``update_policy_weights_()``. ``weights`` is an
        nn.Module, a TensorDict or a state_dict; ``worker_ids`` picks remote collectors
        by index (default: all of them, and every other receiver of the model at the
        hub, an evaluator attached to it, say). Raises
        :class:`~raysync.SpecMismatchError` naming the first key whose shape or dtype
        differs from the collectors' model,
        :class:`~raysync.UnknownModelError` for a model id the hub does not know, and
        :class:`~raysync.BroadcastError` if a receiver failed to apply it (within
        ``timeout_s``). While Ray restarts the hub, and until a restarted hub knows the
        collectors again (each registers again within a heartbeat), the update is
        tried again, within ``timeout_s``. A remote collector Ray restarted comes back
        as TorchRL built it, without its receiver: it is attached again and the update
        sent again (the collectors that applied it get the same weights once more).
        """
        if self._hub is None:
            raise RuntimeError(
                f"RaySyncScheme for model {self.model_id!r} is not initialized on the "
                "sender: hand it to RayCollector(weight_sync_schemes={...}), which calls "
                "init_on_sender, before sending weights"
            )
        collectors = self._targets(worker_ids)
        if worker_ids is not None and not collectors:
            return  # no collector named: nothing to send, as TorchRL's own schemes do
        source = weights if weights is not None else self.model
        if isinstance(source, torch.nn.Module):
            prepared = _synced_weights_of(source)
        else:
            prepared = self.prepare_weights(
                weights=source, model_id=self.model_id, strategy=self.strategy, context=self.context
            )
            learner = None if self._model_ref is None else self._model_ref()
            if isinstance(prepared, TensorDictBase) and isinstance(learner, torch.nn.Module):
                # TorchRL's usual update, TensorDict.from_module(policy), holds the buffers
                # the policy does not save too: they stay each process's own here as well.
                prepared = _without_unsaved(prepared, learner)
        # All of them: every receiver of the model at the hub (an evaluator attached to
        # it too), which must list each of this scheme's collectors.
        workers = None if worker_ids is None else collectors
        deadline = time.monotonic() + self._timeout_s
        looked_for_restarted = False
        published = False  # whether a try of this update reached the hub's receivers
        while True:
            error: Exception | None = None
            try:
                # In the try: the handle asks a hub it has no route from yet (the first
                # update, or the one after a failed one) for it, and a hub Ray is
                # restarting answers that with ActorUnavailableError.
                ack = self._hub.broadcast.remote(
                    prepared,
                    model=self.hub_model,
                    workers=workers,
                    timeout_s=max(deadline - time.monotonic(), _REGISTERED_AGAIN_LOOK_S),
                )
                self.last_report, published = ray.get(ack), True
                unknown = [w for w in collectors if w not in self.last_report.acked]
                if not unknown:
                    return
            except BroadcastError as err:
                # Who applied it, and why the others did not.
                self.last_report, published = err.report, True
                if time.monotonic() > deadline or not self._attach_restarted(
                    err.report.failed, deadline
                ):
                    raise
                continue
            except (UnknownWorkerError, ray.exceptions.ActorUnavailableError) as err:
                error = err
                unknown = collectors if isinstance(err, UnknownWorkerError) else []
            # A hub Ray is restarting (the update may or may not have gone out: the same
            # weights again are harmless), or restarted and knows each collector again
            # once its hub watch registered it (a heartbeat): until then, try again.
            # Unless a collector it does not know is dead: the hub dropped it, and no
            # wait brings it back. One Ray restarted after the hub dropped it (its
            # attach, after the delivery that failed, did not come through) holds no
            # receiver: it is attached again here.
            if unknown:
                dead = self._dead(unknown)
                if dead:
                    report = self.last_report if published else None
                    sent = (
                        f"version {report.version} reached the others (scheme.last_report)"
                        if report is not None
                        else "nothing was sent"
                    )
                    raise UnknownWorkerError(
                        f"remote collector(s) {', '.join(dead)} of model "
                        f"{self.hub_model!r} died and the hub dropped them: no update "
                        f"reaches them ({sent}; pass worker_ids= to update the others "
                        "without this error)"
                    ) from error
                if not looked_for_restarted:
                    looked_for_restarted = True
                    if self._attach_restarted(unknown, deadline):
                        continue
            if time.monotonic() + _REGISTERED_AGAIN_LOOK_S > deadline:
                if error is not None:
                    raise error
                raise UnknownWorkerError(
                    f"remote collector(s) {', '.join(unknown)} of model {self.hub_model!r} "
                    f"are not registered at the hub after {self._timeout_s} s"
                )
            time.sleep(_REGISTERED_AGAIN_LOOK_S)

    def _attach_restarted(self, workers: Iterable[str], deadline: float) -> bool:
        """In the learner, after a broadcast failed on ``workers`` (or the hub knew them
        not): hand this scheme again to each of those remote collectors that holds no
        receiver of it (a new incarnation Ray restarted), the way RayCollector's
        constructor did, asking all at once until ``deadline``. Whether any was attached
        again; one dead for good, busy or unreachable is left to the report."""
        collectors = {
            w: self._collectors[self._workers.index(w)] for w in workers if w in self._workers
        }
        attached = False
        unconfirmed: set[str] = set()  # registered by a call Ray could not tell ran
        while collectors:
            asked = {
                c.__ray_call__.remote(_holds_receiver, self.model_id): w
                for w, c in collectors.items()
            }
            held = _answers(asked, deadline)
            # Holding one now, a collector whose registration Ray could not confirm got it.
            attached |= any(held.get(w) is True for w in unconfirmed)
            registered = {
                collectors[w].register_scheme_receiver.remote(
                    {self.model_id: self}, synchronize_weights=False
                ): w
                for w, holds in held.items()
                if holds is False
            }
            outcomes = _answers(registered, deadline)
            attached |= any(o not in (_NO_ANSWER, _UNAVAILABLE) for o in outcomes.values())
            unconfirmed = {w for w, o in outcomes.items() if o is _UNAVAILABLE}
            # A call Ray could not tell ran (the collector was still restarting, as
            # its handle saw it): ask again whether it holds a receiver.
            again = {w for w, a in [*held.items(), *outcomes.items()] if a is _UNAVAILABLE}
            collectors = {w: c for w, c in collectors.items() if w in again}
            if collectors and time.monotonic() + _REGISTERED_AGAIN_LOOK_S > deadline:
                break
            if collectors:
                time.sleep(_REGISTERED_AGAIN_LOOK_S)
        return attached

    def _dead(self, workers: list[str]) -> list[str]:
        """Those of ``workers`` whose remote collector's actor is dead (as
        ``"index (worker id)"``)."""
        indices = [self._workers.index(w) for w in workers]
        asked = {self._collectors[i].__ray_ready__.remote(): i for i in indices}
        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=_ALIVE_LOOK_S)
        dead = []
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.ActorDiedError:  # not one Ray is restarting
                dead.append(asked[ref])
            except ray.exceptions.RayError:  # restarting, or unreachable: not dead for good
                pass
        return [f"{i} ({self._workers[i]})" for i in sorted(dead)]

    def _targets(self, worker_ids: int | list[int] | None) -> list[str]:
        if worker_ids is None:
            return list(self._workers)
        indices = [worker_ids] if isinstance(worker_ids, int | torch.device) else list(worker_ids)
        for index in indices:
            if isinstance(index, torch.device):
                raise ValueError(
                    f"worker_ids: {index} is a device; RaySyncScheme updates the remote "
                    f"collectors of model {self.model_id!r} by index (0 to "
                    f"{len(self._workers) - 1}), not local ones by device"
                )
            if not isinstance(index, int) or not 0 <= index < len(self._workers):
                raise ValueError(
                    f"worker_ids: {index!r} is not a remote collector index of model "
                    f"{self.model_id!r} (0 to {len(self._workers) - 1})"
                )
        return [self._workers[index] for index in indices]

    @property
    def hub(self) -> HubHandle | None:
        """The hub (None before ``init_on_sender`` and after :meth:`shutdown`)."""
        return self._hub

    @property
    def hub_model(self) -> str:
        """The model's id at the hub: ``model`` as given, else TorchRL's model id."""
        return self._hub_model_given or self.model_id

    @property
    def workers(self) -> tuple[str, ...]:
        """The remote collectors' worker ids at the hub, by collector index."""
        return self._workers

    @property
    def model(self) -> Any:
        """The model this scheme keeps in sync: the learner's (the RayCollector's
        ``policy``) on the sender, the collector's own in a receiver."""
        if self._model_ref is not None:
            return self._model_ref()
        if self.initialized_on_sender:
            raise AttributeError(
                f"RaySyncScheme has no learner model for {self.model_id!r} (the "
                "RayCollector was built with policy_factory): pass the weights, "
                "update_policy_weights_(TensorDict.from_module(policy))"
            )
        return None

    @model.setter
    def model(self, value: Any) -> None:
        WeightSyncScheme.model.fset(self, value)

    def create_transport(self, **kwargs: Any) -> Any:
        """Not used: weights travel through the raysync hub, not a TorchRL transport."""
        raise TypeError("RaySyncScheme moves weights through its raysync hub, not a transport")

    # -- a remote collector's side ------------------------------------------------------------
    def _init_on_receiver_impl(
        self,
        model_id: str,
        context: Any = None,
        *,
        worker_idx: int | None = None,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        """In a remote collector: attach its model to the hub, in push mode."""
        if self._hub is None:
            raise RuntimeError(
                f"RaySyncScheme for model {model_id!r} reached a collector before "
                "init_on_sender ran in the learner"
            )
        self.model_id = model_id
        self.context = context
        if worker_idx is None and context is not None:
            worker_idx = getattr(context, "worker_idx", None)
        if worker_idx is None or not 0 <= worker_idx < len(self._workers):
            raise ValueError(
                f"RaySyncScheme for model {model_id!r}: this collector's worker_idx "
                f"{worker_idx!r} is not one of the {len(self._workers)} the learner knows"
            )
        self.worker_idx = worker_idx
        target = model if model is not None else _collector_model(context, model_id)
        self.model = target
        self._receiver = attach(
            self._hub,
            {self.hub_model: _synced_weights_of(target)},
            owner=context,
            worker_id=self._workers[worker_idx],
            transport=self._transport if self._hub_given is not None else None,
            timeout_s=self._timeout_s,
            on_applied=self._pass_on,
        )

    def _pass_on(self, hub_model: str, version: int) -> None:
        """After each applied version, in the collector's actor: hand the weights to the
        collector's own ``update_policy_weights_``, as TorchRL's schemes do (it updates
        sub-collectors' workers and bumps the collector's policy version). Only for a
        model the collector can take that way: one its own schemes sync (a
        multi-process collector's), or, with none, its policy (a ``Collector`` raises
        ``KeyError`` for any other id, and the version, applied, would fail its ack). The
        collector's policy version is then ``version``."""
        context, model_id = self.context, self.model_id
        if context is None:
            return
        schemes = getattr(context, "_weight_sync_schemes", None) or {}
        if model_id in schemes or (not schemes and model_id == "policy"):
            context.update_policy_weights_(
                model_id=model_id, policy_or_weights=_weights_of(self.model)
            )
        if model_id == "policy" and hasattr(context, "_set_received_policy_version"):
            # The collector's policy version (``track_policy_version``) is the version it
            # applied, as TorchRL's own schemes set the sender's: counted per update, it
            # ran ahead when an update was sent again (a restarted collector).
            context._set_received_policy_version(version)

    # -- both sides --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Detach a receiver; in the learner, close a hub the scheme started, or have a
        hub it was given drop the collectors TorchRL ended (their receivers could not
        leave it: the next broadcast of the model there would fail them)."""
        super().shutdown()
        receiver, self._receiver = getattr(self, "_receiver", None), None
        if receiver is not None:
            receiver.close()
        if getattr(self, "_owns_hub", False):
            self._close_own_hub()
        elif self._hub is not None and self._collectors:
            self._forget_ended_collectors(self._hub)

    def _forget_ended_collectors(self, hub: HubHandle) -> None:
        """In the learner: the given hub drops those of this scheme's collectors that died."""
        try:
            ray.get(hub.drop_if_dead.remote(list(self._workers)), timeout=self._timeout_s)
        except ray.exceptions.RayError as err:  # a hub gone or busy: its next broadcast tells
            logger.warning(
                "the hub did not drop the ended collectors of model %r: %s", self.hub_model, err
            )
        self._collectors = ()

    def _close_own_hub(self) -> None:
        """In the learner: close the hub this scheme started, and forget it."""
        hub, self._hub, self._owns_hub = self._hub, None, False
        if hub is None:
            return
        try:
            hub.release()
            ray.get(hub.close.remote(), timeout=self._timeout_s)
        finally:  # a close that timed out still ends the hub this scheme started
            ray.kill(hub.actor)

    def __getstate__(self) -> dict[str, Any]:
        """What TorchRL pickles to each remote collector: the hub's handle and the
        receivers' names, never the learner's ownership of the hub or a receiver."""
        state = super().__getstate__()
        state.update(_receiver=None, _owns_hub=False, last_report=None, _collectors=())
        return state


def _worker_id(scheme_id: str, model_id: str, index: int) -> str:
    """A remote collector's name at the hub (in reports and ``hub.status``)."""
    return f"torchrl-{scheme_id}-{model_id}-{index}"


#: What :func:`_answers` gives a call that raised or did not answer in time, and one
#: Ray could not tell ran (the actor was restarting).
_NO_ANSWER = object()
_UNAVAILABLE = object()


def _answers(calls: dict[Any, str], deadline: float) -> dict[str, Any]:
    """Each of ``calls`` (ObjectRef -> worker) answered by ``deadline``: worker -> its
    result, ``_UNAVAILABLE`` or ``_NO_ANSWER``."""
    if not calls:
        return {}
    timeout = max(0.0, deadline - time.monotonic())
    ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=timeout)
    answers: dict[str, Any] = dict.fromkeys(calls.values(), _NO_ANSWER)
    for ref in ready:
        try:
            answers[calls[ref]] = ray.get(ref)
        except ray.exceptions.ActorUnavailableError:
            answers[calls[ref]] = _UNAVAILABLE
        except ray.exceptions.RayError:
            pass
    return answers


def _holds_receiver(collector: Any, model_id: str) -> bool:
    """Runs in a remote collector (``__ray_call__``): whether a RaySyncScheme of
    ``model_id`` was handed to this process and attached its model."""
    scheme = getattr(collector, "_receiver_schemes", {}).get(model_id)
    return isinstance(scheme, RaySyncScheme) and scheme._receiver is not None


def _collector_model(context: Any, model_id: str) -> Any:
    """The model ``model_id`` (an attribute path) of a remote collector, ``context``. A
    multi-process collector built from a ``policy_factory`` holds no policy in its own
    process: one is made from the factory, as TorchRL's Ray scheme does, to receive
    into and pass on to the workers."""
    if context is None:
        raise ValueError(f"RaySyncScheme needs the collector, or the model {model_id!r}")
    model = resolve(context, model_id)
    if model is None and model_id == "policy":
        factory = (getattr(context, "policy_factory", None) or [None])[0]
        if factory is None:
            raise ValueError("the remote collector has neither a policy nor a policy_factory")
        model = context.policy = factory()
    if model is None:
        raise ValueError(f"the remote collector's {model_id!r} is None")
    return model


def _synced_weights_of(model: Any) -> TensorDictBase:
    """What the hub's receivers of ``model`` hold in sync, written in place: its
    parameters and buffers (:func:`_weights_of`) but those a module does not save
    (``register_buffer(..., persistent=False)``: a mask, a cache), which stay each
    process's own as they do wherever raysync moves a module (its ``state_dict``): an
    evaluator attached with the module, and an update of the learner's
    ``policy.state_dict()``, so agree with the collectors."""
    weights = _weights_of(model)
    if not isinstance(model, torch.nn.Module):
        return weights
    return _without_unsaved(weights, model)


def _without_unsaved(weights: TensorDictBase, module: torch.nn.Module) -> TensorDictBase:
    """``weights`` (``module``'s, as ``TensorDict.from_module`` lays them out) without
    the buffers ``module`` does not save."""
    unsaved = [
        (*filter(None, prefix.split(".")), name)
        for prefix, submodule in module.named_modules(remove_duplicate=False)
        for name in submodule._non_persistent_buffers_set
    ]
    return weights.exclude(*unsaved) if unsaved else weights


def _weights_of(model: Any) -> TensorDictBase:
    """The tensors TorchRL moves for ``model`` (its ``"tensordict"`` strategy): a
    TensorDict of the module's own parameters and buffers, written in place."""
    if isinstance(model, torch.nn.Module):
        return TensorDict.from_module(model)
    if isinstance(model, TensorDictBase):
        return model
    raise TypeError(
        f"RaySyncScheme keeps nn.Modules and TensorDicts in sync, not {type(model).__name__}"
    )

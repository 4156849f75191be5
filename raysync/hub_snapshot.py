"""Where a hub's model versions and specs survive a restart of its actor.

Ray's GCS key-value store holds them under the actor's id, which a restarted actor
keeps. Called from the hub actor's process only: versions are written on every
broadcast (a few bytes), a model's spec only when it is new or changed (a 1000-tensor
spec pickles to ~23 KB, too much to write again on every broadcast). A model a dropped
receiver alone had registered, never published, leaves it with its spec.
"""

from __future__ import annotations

import pickle
from collections.abc import Collection

from ray.experimental import internal_kv

from raysync.spec import WeightSpec

#: GCS key-value namespace of the hubs' restart snapshots.
KV_NAMESPACE = "raysync"


class HubSnapshot:
    """The restart snapshot of the hub actor ``actor_id``."""

    def __init__(self, actor_id: str) -> None:
        self._prefix = f"hub/{actor_id}/"
        self._saved_digests: dict[str, str] = {}
        self._saved_transports: tuple[str, ...] | None = None
        self._saved_versions: dict[str, int] = {}

    def save(
        self,
        versions: dict[str, int],
        specs: dict[str, WeightSpec],
        transports: tuple[str, ...] = (),
    ) -> None:
        """``transports``: the hub's and those its receivers read by now (written when
        they change): a restarted hub opens them and has its learners hand versions
        over to them until those receivers are back (see ``WeightHubActor.transports``)."""
        for model, spec in specs.items():
            if self._saved_digests.get(model) != spec.digest:
                self._put(f"spec/{model}", pickle.dumps(spec))
                self._saved_digests[model] = spec.digest
        if transports != self._saved_transports:
            self._put("transports", pickle.dumps(transports))
            self._saved_transports = transports
        self._put("versions", pickle.dumps(versions))
        self._saved_versions = dict(versions)

    def save_registered(
        self,
        versions: dict[str, int],
        specs: dict[str, WeightSpec],
        transports: tuple[str, ...],
    ) -> None:
        """After a registration: what a restarted hub must know before this hub's next
        version is saved, if anything is new (else nothing is written): a transport a
        receiver reads by (the restarted hub hands versions over to it until that
        receiver is back), a model the hub was not started with, and a spec new to the
        snapshot (a declared model's, after the one a dropped receiver brought was
        forgotten: see :meth:`save_forgotten`). A saved version is never lowered:
        ``versions`` is the hub's own, which a save before publishing may be ahead of."""
        merged = dict(self._saved_versions)
        for model, version in versions.items():
            merged[model] = max(version, merged.get(model, 0))
        new_spec = any(self._saved_digests.get(m) != spec.digest for m, spec in specs.items())
        if merged != self._saved_versions or transports != self._saved_transports or new_spec:
            self.save(merged, specs, transports)

    def save_forgotten(
        self, models: Collection[str], versions: dict[str, int], specs: dict[str, WeightSpec]
    ) -> None:
        """After a receiver was dropped: of its ``models``, what the hub forgot with it
        (``versions`` and ``specs`` are the hub's now) leaves the snapshot too, else a
        restarted hub would know it again; nothing is written if nothing saved was
        forgotten. A model without a spec now loses its saved one, and, unknown to the
        hub now, its version too; one saved with a number stays as it is (a saved
        version is never lowered: a restarted hub must not number it again)."""
        forgotten = [m for m in models if m not in specs and not self._saved_versions.get(m)]
        kept = {
            model: version
            for model, version in self._saved_versions.items()
            if model in versions or model not in forgotten
        }
        if kept != self._saved_versions:
            self._put("versions", pickle.dumps(kept))
            self._saved_versions = kept
        for model in forgotten:
            if self._saved_digests.pop(model, None) is not None:
                self._delete(f"spec/{model}")

    def load_transports(self) -> tuple[str, ...]:
        """The transports saved last; empty if none were."""
        raw = internal_kv._internal_kv_get(self._prefix + "transports", namespace=KV_NAMESPACE)
        self._saved_transports = pickle.loads(raw) if raw is not None else ()
        return self._saved_transports

    def load(self) -> tuple[dict[str, int], dict[str, WeightSpec]]:
        """The saved versions and specs; empty if this hub never saved any."""
        raw = internal_kv._internal_kv_get(self._prefix + "versions", namespace=KV_NAMESPACE)
        versions: dict[str, int] = pickle.loads(raw) if raw is not None else {}
        self._saved_versions = dict(versions)
        specs = {}
        for model in versions:
            raw = internal_kv._internal_kv_get(
                self._prefix + f"spec/{model}", namespace=KV_NAMESPACE
            )
            if raw is not None:
                specs[model] = pickle.loads(raw)
                self._saved_digests[model] = specs[model].digest
        return versions, specs

    def delete(self) -> None:
        internal_kv._internal_kv_del(self._prefix, del_by_prefix=True, namespace=KV_NAMESPACE)

    def _delete(self, key: str) -> None:
        internal_kv._internal_kv_del(self._prefix + key, namespace=KV_NAMESPACE)

    def _put(self, key: str, value: bytes) -> None:
        internal_kv._internal_kv_put(
            self._prefix + key, value, overwrite=True, namespace=KV_NAMESPACE
        )

"""Which updates a receiver applies: by version, and by origin when two learners that
deliver themselves guess the same version number (``receiver_core._refusal``)."""

from __future__ import annotations

import pytest

from raysync.messages import AckStatus, Update
from raysync.receiver_core import HeldModel, _refusal


def _held(version: int, origin: str = "") -> HeldModel:
    return HeldModel("policy", "policy", version=version, origin=origin)


def _update(version: int, origin: str, *, from_learner: bool) -> Update:
    return Update(
        "policy", version, "digest", "object_store", None, origin=origin, from_learner=from_learner
    )


@pytest.mark.parametrize("from_learner", [False, True])
def test_a_newer_version_is_applied_an_older_one_superseded(from_learner):
    held = _held(3, "a")
    assert _refusal(held, _update(4, "b", from_learner=from_learner)) is None
    assert _refusal(held, _update(2, "a", from_learner=from_learner)) is AckStatus.SUPERSEDED
    assert _refusal(held, _update(2, "b", from_learner=from_learner)) is AckStatus.SUPERSEDED


@pytest.mark.parametrize("from_learner", [False, True])
def test_the_same_version_from_the_same_learner_is_superseded(from_learner):
    assert _refusal(_held(3, "a"), _update(3, "a", from_learner=from_learner)) is (
        AckStatus.SUPERSEDED
    )


def test_the_hubs_update_replaces_another_learners_own_delivery_of_that_number():
    assert _refusal(_held(3, "a"), _update(3, "b", from_learner=False)) is None


def test_another_learners_own_delivery_of_a_held_number_is_a_conflict():
    assert _refusal(_held(3, "a"), _update(3, "b", from_learner=True)) is AckStatus.CONFLICT


def test_a_version_held_without_an_origin_is_never_replaced():
    """Version 0 (nothing applied yet) or one a receiver brought to a restarted hub."""
    assert _refusal(_held(3), _update(3, "b", from_learner=False)) is AckStatus.SUPERSEDED

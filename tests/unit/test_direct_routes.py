"""The hub's book of the version numbers routes hand to learners (``DirectRoutes``):
no number names two broadcasts' weights, whoever numbers them."""

from __future__ import annotations

from raysync.direct_routes import LEARNERS_KEPT, DirectRoutes


def test_a_sole_learner_is_routed_the_next_version_each_time():
    routes = DirectRoutes()
    assert routes.route("policy", "a", published=0) == 1
    assert routes.route("policy", "a", published=1) == 2
    assert routes.next_version("policy", "a", published=2) == 3  # its own number is its own


def test_the_hub_numbers_another_learners_broadcast_above_a_number_routed_and_not_booked():
    routes = DirectRoutes()
    routes.submitted("policy", "a", direct=True)
    assert routes.route("policy", "a", published=4) == 5  # "a" may be delivering 5 now
    assert routes.next_version("policy", "b", published=4) == 6
    assert routes.next_version("policy", "a", published=4) == 5
    # Once something took 5 or above, "a"'s number is spent: nothing is skipped for it.
    assert routes.next_version("policy", "b", published=6) == 7


def test_two_learners_are_routed_different_numbers():
    routes = DirectRoutes()
    assert routes.route("policy", "a", published=2) == 3
    assert routes.route("policy", "b", published=2) == 4
    assert routes.route("policy", "c", published=2) == 5
    for learner in "abc":
        routes.submitted("policy", learner, direct=True)
    assert routes.next_version("policy", "a", published=2) == 6
    assert routes.routed_to_another("policy", "b", 3)
    assert routes.routed_to_another("policy", "a", 4)
    assert not routes.routed_to_another("policy", "a", 3)
    assert not routes.routed_to_another("policy", "a", 6)


def test_a_learner_routed_again_gives_up_its_former_number():
    routes = DirectRoutes()
    routes.submitted("policy", "a", direct=True)
    assert routes.route("policy", "a", published=2) == 3
    assert routes.route("policy", "a", published=3) == 4
    assert not routes.routed_to_another("policy", "b", 3)
    assert routes.next_version("policy", "b", published=3) == 5


def test_models_are_numbered_apart():
    routes = DirectRoutes()
    assert routes.route("policy", "a", published=0) == 1
    assert routes.route("critic", "b", published=0) == 1
    routes.submitted("critic", "b", direct=True)
    assert routes.next_version("critic", "a", published=0) == 2
    assert routes.next_version("policy", "b", published=0) == 2  # "a"'s 1 of policy


def test_learners_beyond_those_kept_are_forgotten_oldest_first():
    routes = DirectRoutes()
    routes.route("policy", "oldest", published=0)
    for i in range(LEARNERS_KEPT):
        routes.route("policy", f"learner-{i}", published=0)
    assert not routes.routed_to_another("policy", "x", 1)
    assert routes.routed_to_another("policy", "x", LEARNERS_KEPT + 1)


def test_forgotten_models_keep_no_numbers():
    routes = DirectRoutes()
    routes.route("policy", "a", published=0)
    routes.route("critic", "a", published=0)
    routes.submitted("policy", "a", direct=True)
    routes.submitted("critic", "a", direct=True)
    routes.forget(["critic"])
    assert routes.next_version("policy", "b", published=0) == 1
    assert routes.next_version("critic", "b", published=0) == 2


def test_a_learner_that_goes_through_the_hub_holds_no_number_up():
    """Parts of a sharded version, buckets, explicit versions: such a learner's route
    still names a number, but its broadcasts do not deliver it, and the versions the
    hub numbers for the others run on without a gap."""
    routes = DirectRoutes()
    assert routes.route("policy", "part-0", published=0) == 1
    assert routes.route("policy", "part-1", published=0) == 2  # routes stay apart
    routes.submitted("policy", "part-0", direct=False)
    assert routes.next_version("policy", "part-1", published=0) == 1
    routes.submitted("policy", "part-0", direct=True)  # it delivered one itself since
    assert routes.next_version("policy", "part-1", published=0) == 2
    routes.submitted("policy", "part-0", direct=False)  # and went through the hub again
    assert routes.next_version("policy", "part-1", published=0) == 1


def test_a_number_routed_for_a_learners_first_broadcast_is_held_up_until_it_comes():
    """Whether that learner will deliver it itself is not known before its broadcast
    reaches the hub: a broadcast numbered meanwhile skips it (a gap at worst)."""
    routes = DirectRoutes()
    assert routes.route("policy", "new", published=7) == 8
    assert routes.next_version("policy", "other", published=7) == 9
    routes.submitted("policy", "new", direct=False)
    assert routes.next_version("policy", "other", published=7) == 8


def test_a_learner_routed_after_going_through_the_hub_holds_its_new_number_up():
    """Its report's route may be the one its next broadcast delivers itself."""
    routes = DirectRoutes()
    routes.submitted("policy", "a", direct=False)  # bucketed, say
    assert routes.route("policy", "a", published=5) == 6  # in that broadcast's report
    assert routes.next_version("policy", "b", published=5) == 7


def test_a_learner_that_ended_holds_nothing_up():
    routes = DirectRoutes()
    assert routes.route("policy", "released", published=5) == 6
    routes.forget_learner("released")
    assert routes.route("policy", "its-next-side", published=5) == 6
    assert not routes.routed_to_another("policy", "its-next-side", 6)

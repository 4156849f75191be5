"""Where a broadcast's time went (raysync.messages.BroadcastPhases), from the receivers' acks."""

from __future__ import annotations

from raysync.messages import BroadcastPhases, ReceiverTimings, Spread


def test_each_receiver_phase_is_spread_over_the_receivers_that_applied():
    applied = [
        (0.5, ReceiverTimings(fetch_s=0.1, wait_s=0.0, apply_s=0.01)),
        (0.9, ReceiverTimings(fetch_s=0.3, wait_s=0.4, apply_s=0.03)),
        (0.6, ReceiverTimings(fetch_s=0.2, wait_s=0.1, apply_s=0.02)),
    ]
    phases = BroadcastPhases.of(learner_s=0.05, plan_s=0.002, applied=applied)
    assert (phases.learner_s, phases.plan_s) == (0.05, 0.002)
    assert phases.deliver_s == Spread(p50=0.6, max=0.9, count=3)
    assert phases.fetch_s == Spread(p50=0.2, max=0.3, count=3)
    assert phases.wait_s == Spread(p50=0.1, max=0.4, count=3)
    assert phases.apply_s == Spread(p50=0.02, max=0.03, count=3)


def test_the_median_of_an_even_count_is_the_mean_of_the_middle_two():
    assert Spread.of([4.0, 1.0, 3.0, 2.0]) == Spread(p50=2.5, max=4.0, count=4)


def test_no_receiver_applied_no_spread():
    phases = BroadcastPhases.of(learner_s=0.05, plan_s=0.0, applied=[])
    assert phases.deliver_s is phases.fetch_s is phases.wait_s is phases.apply_s is None

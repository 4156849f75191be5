"""``python -m raysync doctor --address ...``: the check runs on every node of a cluster."""

from __future__ import annotations

import ray

from raysync.doctor import check_cluster, render
from raysync.transports import known_transports, registered_transports


def test_every_alive_node_is_checked(ray_cluster):
    reports = check_cluster()
    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    assert len(reports) == len(alive)
    assert {r.where.split()[1] for r in reports} == {node[:12] for node in alive}
    # raysync's own transports: a third party's registered in this process only (the
    # conformance tests do) is not known to the nodes' task processes.
    third_party = dict(registered_transports())
    built_in = [name for name in known_transports() if name not in third_party]
    for report in reports:
        assert [c.name for c in report.transports] == built_in
    assert render(reports).count("== node ") == len(alive)


def test_a_node_that_does_not_answer_in_time_is_reported_with_why(ray_cluster):
    """A node whose check hangs (its worker never starts) held the whole report up for
    good; one where it raised failed the whole report. Each is reported, with why."""
    reports = check_cluster(timeout_s=0)  # no check answers in no time
    assert reports and all(r.error == "no answer within 0 s" for r in reports)
    assert render(reports).count("could not check: no answer within 0 s") == len(reports)

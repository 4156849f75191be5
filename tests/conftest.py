"""One Ray cluster for the whole session, and helpers that clean up after each test."""

from __future__ import annotations

import os
import socket

import pytest
import ray
import torch

from tests.helpers import SharedHubs, transport_params

# Two cores on CI: a larger logical CPU count lets many small actors coexist;
# receivers in the tests also ask for num_cpus=0.
_CLUSTER_CPUS = 32


@pytest.fixture(scope="session")
def ray_cluster():
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray's own metrics export interval (10 s) is kept: a shorter one makes every actor
    # process and Ray's metrics agent export more often for the whole session (measured:
    # +0.04 cores for a hub and two idle receivers at 500 ms), and only the metrics test
    # waits for an export (it scrapes until its values appear).
    ray.init(
        address="local",  # always a fresh cluster, never one left running on the machine
        num_cpus=_CLUSTER_CPUS,
        include_dashboard=False,
        object_store_memory=1 << 30,
        log_to_driver=True,
        _metrics_export_port=_free_port(),
    )
    try:
        yield ray.get_runtime_context()
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def metrics_url(ray_cluster) -> str:
    """Ray's Prometheus endpoint on this node (served by the dashboard agent of
    ``ray[default]``, the ``metrics`` extra)."""
    port = ray._private.worker.global_worker.node.metrics_export_port
    return f"http://127.0.0.1:{port}/metrics"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def shared_hubs(ray_cluster):
    """A hub and a receiver per transport, shared by tests that leave them alive."""
    hubs = SharedHubs()
    yield hubs
    hubs.close()


@pytest.fixture(autouse=True)
def _release_shared_learner_sides(request):
    """After a test that used the shared hubs, their learner sides are released: a
    learner's NIXL agent kept for the whole session was seen spinning a core."""
    yield
    if "shared_hubs" in request.fixturenames:
        request.getfixturevalue("shared_hubs").release_learner_sides()


@pytest.fixture
def actors(ray_cluster):
    """A list the test appends actor handles to; every one is killed after the test."""
    created: list = []
    yield created
    for handle in created:
        actor = getattr(handle, "actor", handle)
        try:
            ray.kill(actor)
        except Exception:  # already dead: that is what some tests are about
            pass


@pytest.fixture(params=transport_params())
def transport(request) -> str:
    """Each transport registered in raysync; unavailable ones are skipped with the reason."""
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

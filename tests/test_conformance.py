"""The conformance kit (``raysync.testing``) run against every transport raysync ships,
and against a transport written outside it (``tests/third_party_transport.py``),
registered the public way."""

from __future__ import annotations

import pytest

from raysync import DistributedOptions, RpcOptions
from raysync.testing import TransportConformance
from raysync.transports import get_transport, register_transport
from tests.third_party_transport import PackedObjectTransport

register_transport("packed_object", PackedObjectTransport)

pytestmark = pytest.mark.usefixtures("ray_cluster")  # the session's cluster, started first


def _runs_here(name: str) -> pytest.MarkDecorator:
    availability = get_transport(name).availability()
    return pytest.mark.skipif(
        not availability.available, reason=f"{name} unavailable: {availability.reason}"
    )


class TestObjectStore(TransportConformance):
    transport = "object_store"


class TestSharedMemory(TransportConformance):
    transport = "shared_memory"
    pytestmark = _runs_here("shared_memory")


class TestDistributed(TransportConformance):
    transport = "distributed"
    hub_options = {"options": DistributedOptions(timeout_s=10)}


class TestRpc(TransportConformance):
    transport = "rpc"
    hub_options = {"options": RpcOptions(timeout_s=10)}


class TestNixl(TransportConformance):
    transport = "nixl"
    pytestmark = [pytest.mark.nixl, _runs_here("nixl")]


class TestRdt(TransportConformance):
    """``slow`` (``make test-all``): every broadcast but the first two waits in
    ``wait_tensor_freed`` for Ray to free the reused buffer's ObjectRef. The class took
    130-160 s on this machine while Ray's NIXL agent spun a core in every process, 57 s
    since raysync makes that agent itself (``raysync/transports/rdt/agent.py``);
    tests/test_rdt.py covers rdt in ``make test``."""

    transport = "rdt"
    receiver_options = {"enable_tensor_transport": True}
    pytestmark = [pytest.mark.nixl, pytest.mark.slow, _runs_here("rdt")]


class TestThirdParty(TransportConformance):
    """A transport raysync does not ship: the hub and the receivers learn it from the
    hub's config, registered in this process only."""

    transport = "packed_object"

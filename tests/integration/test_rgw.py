"""``tools.rgw``: Ceph RGW for ``make test-rgw`` listens on 127.0.0.1 only, keeps buckets across a gateway
stop and start, and leaves nothing behind. Runs only with ``TRAINYARD_TEST_S3=rgw`` (CI does not)."""

from __future__ import annotations

import os

import psutil
import pytest
from minio import Minio

from tools import rgw

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.environ.get("TRAINYARD_TEST_S3") != "rgw", reason="Ceph RGW runs under make test-rgw only"),
]


def test_a_cluster_on_127_0_0_1_only_keeps_buckets_across_a_gateway_restart_then_nothing_is_left() -> None:
    server = rgw.start()
    try:
        pids = {name: p.pid for name, p in server.daemons.items()}
        assert set(pids) == {"mon", "osd", "rgw"}
        for name, pid in pids.items():
            bound = {c.laddr.ip for c in psutil.Process(pid).net_connections("inet") if c.status == "LISTEN"}
            assert bound <= {"127.0.0.1"}, (name, bound)
        client = Minio(
            f"127.0.0.1:{server.port}", server.access_key, server.secret_key, secure=False, region="us-east-1"
        )
        client.make_bucket("kept")
        server.stop()
        assert not psutil.pid_exists(pids["rgw"])  # the gateway only: the cluster keeps the bucket
        server.start()
        assert client.bucket_exists("kept")
    finally:
        server.discard()
    assert not any(psutil.pid_exists(pid) for pid in pids.values())
    assert not server.folder.exists()

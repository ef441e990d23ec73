"""Dialling is the host's own policy: a peer that leaves is not redialled by py-libp2p's
auto-connector (which, left on, dials every peer ever seen, forever)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.host import SwarmHost
from skillswarm.protocol.identity import load_or_create_identity

AUTO_CONNECTOR_LOGGER = "libp2p.network.auto_connector"


def test_a_departed_peer_is_not_redialled(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG, logger=AUTO_CONNECTOR_LOGGER)
    staying = SwarmHost(load_or_create_identity(tmp_path / "a.key"), BlobStore(tmp_path / "a"), "t")
    leaving = SwarmHost(load_or_create_identity(tmp_path / "b.key"), BlobStore(tmp_path / "b"), "t")
    with staying:
        with leaving:
            leaving.connect(staying.listen_addrs[0])
            deadline = time.monotonic() + 10
            while leaving.peer_id not in staying.connected_peers():
                assert time.monotonic() < deadline, "the peers never connected"
                time.sleep(0.05)
        caplog.clear()
        time.sleep(10)  # the auto-connector reacts to a disconnect at once, then every 30 s
        dials = [r.getMessage() for r in caplog.records if r.name == AUTO_CONNECTOR_LOGGER]
        assert dials == []
        assert leaving.peer_id not in staying.connected_peers()

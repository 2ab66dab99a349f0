"""Runtime bugs the fault matrix found, each as the smallest run that shows it.

Each test is marked ``xfail(strict=True)`` with the reason until the runtime
is fixed: a fix makes it pass, and strict turns that into a failure, so the
mark is removed with the fix."""

from __future__ import annotations

import time

import pytest

import kvproto
from kvproto import errors
from kvproto.checking.chaos.cluster import Cluster, Settings

pytestmark = [pytest.mark.faults, pytest.mark.runtime]


@pytest.mark.xfail(strict=True, reason=(
    "a storage node left out of a new master's recovery (its fence answer came after the "
    "fence timeout) registers again under the same segment id, with its regions and index; "
    "the master takes it for an empty segment, so its assigns collide with the node's old "
    "regions (RegionMismatch) and those regions are never freed"))
def test_a_node_fenced_out_of_recovery_rejoins_as_an_empty_segment(tmp_path):
    settings = Settings(storage_nodes=2, segment_size=1 << 20)
    cluster = Cluster(tmp_path, settings)
    try:
        cluster.start()
        with kvproto.Client(cluster.coordinator, timeout=10, switch_window=30) as client:
            for i in range(16):
                client.put(f"before-{i}", b"x" * 3000)
            late = cluster.storage[0]
            # the node's answer to the next fence arrives after the fence timeout
            cluster.proxy.rule(route=late.route, direction="reply", ops="fence", action="delay",
                               delay_ms=int(settings.fence_timeout * 3000), count=1)
            old = cluster.open_leader()
            old.signal(9)
            cluster.wait(lambda: cluster.open_leader() not in (None, old), 60, "a new master")
            cluster.wait(lambda: cluster.live_segments() == 2, 60, "the late node to register again")
            node = cluster.node_stats(late)
            at_master = cluster.master_stats()["segments"][node["segment"]]
            # the master and the node must agree on what the segment holds ...
            assert (at_master["used"], at_master["allocator_free"]) == \
                (node["used"], node["capacity"] - node["used"]), (at_master, node)
            # ... and every put must find room
            failed = [e for e in client.put_many([(f"after-{i}", b"y" * 3000) for i in range(32)])
                      if e is not None]
            assert not failed, failed[:3]
    finally:
        cluster.stop()


@pytest.mark.xfail(strict=True, reason=(
    "a storage node left out of a new master's recovery keeps its index; when it registers "
    "again and a later master fences it, objects removed in between (acknowledged) come back"))
def test_an_object_removed_while_its_node_was_fenced_out_comes_back(tmp_path):
    settings = Settings(storage_nodes=2, segment_size=1 << 20)
    cluster = Cluster(tmp_path, settings)
    try:
        cluster.start()
        with kvproto.Client(cluster.coordinator, timeout=10, switch_window=30) as client:
            keys = [f"k-{i}" for i in range(8)]
            for key in keys:
                client.put(key, b"x" * 3000, replicas=2)
            late = cluster.storage[0]
            cluster.proxy.rule(route=late.route, direction="reply", ops="fence", action="delay",
                               delay_ms=int(settings.fence_timeout * 3000), count=1)
            first = cluster.open_leader()
            first.signal(9)
            cluster.wait(lambda: cluster.open_leader() not in (None, first), 60, "a second master")
            cluster.heal()
            time.sleep(settings.lease_ttl * 1.5)        # the leases a new master inherits
            for key in keys:
                client.remove(key)                       # acknowledged
            assert not any(client.exists_many(keys))
            cluster.wait(lambda: cluster.live_segments() == 2, 60, "the late node to register again")
            second = cluster.open_leader()
            second.signal(9)
            cluster.wait(lambda: cluster.open_leader() not in (None, first, second), 60, "a third master")
            back = [k for k, hit in zip(keys, client.exists_many(keys)) if hit]
            assert not back, f"removed and acknowledged, yet stored again: {back}"
    finally:
        cluster.stop()

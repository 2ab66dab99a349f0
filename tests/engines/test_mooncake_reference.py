"""Differential: the same calls on the real Mooncake Store and on kvproto's
Mooncake API give the same return values, except where kvproto deliberately
differs (docs/engines.md). Skipped, with the reason, where Mooncake is not
installed or does not load."""

from __future__ import annotations

import ctypes
import time

import pytest

import kvproto
from kvproto.engines.mooncake import MooncakeDistributedStore
from kvproto.engines.mooncake_reference import ReferenceMaster, real_store

pytestmark = pytest.mark.runtime

MODULE, WHY = real_store()
SEGMENT = 16 << 20


@pytest.fixture(scope="module")
def stores():
    if MODULE is None:
        pytest.skip(f"no reference Mooncake: {WHY}")
    with ReferenceMaster() as master, kvproto.embedded(storage_nodes=0) as cluster:
        real = MODULE.MooncakeDistributedStore()
        assert real.setup(master.setup_config(SEGMENT)) == 0, master.log()[-2000:]
        ours = MooncakeDistributedStore()
        config = dict(master.setup_config(SEGMENT), master_server_addr=cluster.master_address)
        assert ours.setup(config) == 0
        yield real, ours
        real.close()
        ours.close()


def script(s, buf: ctypes.Array, cfg):
    """One sequence of calls; returns what each call returned."""
    p = ctypes.addressof(buf)
    out = []
    r = out.append
    # out of space first: Mooncake evicts unleased objects when an allocation fails
    r(s.put("big", b"x" * (2 * SEGMENT)))
    # Mooncake's master evicts on a background pass after a failed allocation;
    # let that pass run while the store is empty, or it may take "a" below
    time.sleep(1.0)
    r(s.put("a", b"first"))
    r(s.put("a", b"second"))                    # re-put: 0, the first bytes stay
    r(s.put_batch(["b", "c"], [b"bb", b"ccc"]))
    r(s.put_parts("d", b"dd", b"DD"))
    r(s.put_batch(["x1", "x2", "rm"], [b"1", b"2", b"3"]))   # never looked up: no Mooncake lease
    r(s.put("e", b""))                          # empty value
    r(s.put("", b"x"))                          # empty key
    r(s.is_exist("a")), r(s.is_exist("none")), r(s.batch_is_exist(["b", "none", "c"]))
    r(s.get_size("a")), r(s.get_size("none"))    # a lookup: Mooncake leases "a" here
    r(s.register_buffer(p, 256)), r(s.register_buffer(p + 8, 8))
    ctypes.memmove(p, b"0123456789abcdef", 16)
    r(s.put_from("f", p, 10))
    r(s.batch_put_from(["g", "h"], [p, p + 10], [4, 6], cfg))
    r(s.batch_put_from_multi_buffers(["i"], [[p, p + 12]], [[2, 4]], cfg))
    r(s.get_into("g", p + 64, 2))               # too small
    r(s.get_into("g", p + 64, 16)), r(s.get_into("none", p + 64, 16))
    r(s.batch_get_into(["f", "none", "h"], [p + 100, p + 120, p + 140], [16, 16, 16]))
    r(s.batch_get_into_multi_buffers(["i"], [[p + 160, p + 170]], [[3, 3]]))
    r(ctypes.string_at(p + 64, 4)), r(ctypes.string_at(p + 100, 10)), r(ctypes.string_at(p + 140, 6))
    r(ctypes.string_at(p + 160, 3) + ctypes.string_at(p + 170, 3))
    r(s.unregister_buffer(p)), r(s.unregister_buffer(p))
    r(s.remove("rm")), r(s.remove("none"))
    r(s.remove_by_regex("^x[0-9]$"))
    r(s.batch_is_exist(["x1", "x2", "rm", "d"]))
    r(s.get("a")), r(s.get("none")), r(s.get_batch(["a", "none", "h"]))
    h = s.get_buffer("h")
    r((h.size(), bytes(memoryview(h)), ctypes.string_at(h.ptr(), h.size())))
    r(s.get_buffer("none"))
    return out


def test_same_calls_same_results(stores):
    real, ours = stores
    cfg_real, cfg_ours = MODULE.ReplicateConfig(), kvproto.engines.mooncake.ReplicateConfig()
    got_real = script(real, ctypes.create_string_buffer(256), cfg_real)
    got_ours = script(ours, ctypes.create_string_buffer(256), cfg_ours)
    differ = [(i, r, o) for i, (r, o) in enumerate(zip(got_real, got_ours)) if r != o]
    assert not differ, f"(call index, Mooncake, kvproto): {differ}"
    assert -600 in got_real and -200 in got_real and -704 in got_real      # the codes were exercised


@pytest.mark.parametrize("lookup", ["get", "get_size", "is_exist"])
def test_kvproto_holds_a_lease_only_while_a_read_runs(stores, lookup):
    """The deliberate difference: Mooncake grants a lease of its TTL on every
    lookup (get, get_size, is_exist) and leaves it to expire, so a remove right
    after is -706; kvproto leases only a read in progress and ends the lease
    once the read is verified, so the remove succeeds. A remove while a read
    holds a lease is -706 on kvproto too (tests/engines/test_mooncake.py)."""
    real, ours = stores
    key = f"leased-{lookup}"
    for s in (real, ours):
        assert s.put(key, b"v") == 0
        getattr(s, lookup)(key)
    assert real.remove(key) == -706
    assert ours.remove(key) == 0

"""The Mooncake Store API on kvproto: Mooncake's return codes for each
behaviour, both setup forms, a contributed segment that leaves on close, the
zero-copy forms by raw address, and the PYTHONPATH shim."""

from __future__ import annotations

import ctypes
import time
import uuid
import warnings

import pytest

import kvproto
from kvproto import errors
from kvproto.engines import mooncake as mc
from kvproto.engines.mooncake import MooncakeDistributedStore, ReplicateConfig
from kvproto.engines.shim import PATH as SHIM_PATH
from engine_helpers import fresh_import

pytestmark = pytest.mark.runtime


@pytest.fixture(scope="module")
def cluster():
    with kvproto.embedded(storage_nodes=1, segment_size="32MiB") as c:
        yield c


@pytest.fixture
def store(cluster):
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 0, "16MB", "tcp", "", cluster.master_address) == 0
    yield s
    s.close()


@pytest.fixture
def key():
    prefix = uuid.uuid4().hex[:8]
    return lambda name: f"{prefix}/{name}"


class Mem:
    """A ctypes buffer and its address."""

    def __init__(self, size: int) -> None:
        self.buf = ctypes.create_string_buffer(size)
        self.ptr = ctypes.addressof(self.buf)

    def at(self, offset: int, size: int) -> bytes:
        return self.buf.raw[offset:offset + size]


# --- Mooncake's return codes ---------------------------------------------------------

def test_reput_returns_0_and_keeps_the_first_bytes(store, key):
    assert store.put(key("a"), b"first") == 0
    assert store.put(key("a"), b"second value") == 0
    assert store.get(key("a")) == b"first"
    assert store.get_size(key("a")) == 5
    assert store.put_batch([key("a"), key("b")], [b"x", b"y"]) == 0
    assert store.get_batch([key("a"), key("b")]) == [b"first", b"y"]


def test_a_miss_is_minus_704(store, key):
    m = Mem(16)
    assert store.get(key("none")) == b""
    assert store.get_buffer(key("none")) is None
    assert store.get_size(key("none")) == mc.OBJECT_NOT_FOUND == -704
    assert store.get_into(key("none"), m.ptr, 16) == -704
    assert store.remove(key("none")) == -704
    assert store.is_exist(key("none")) == 0
    assert store.batch_is_exist([key("none")]) == [0]


def test_remove_while_leased_is_minus_706(cluster, store, key):
    assert store.put(key("a"), b"leased") == 0
    with cluster.client() as reader:
        lease = reader.read_begin([key("a")])[0]
        assert store.remove(key("a")) == mc.OBJECT_HAS_LEASE == -706
        assert store.batch_remove([key("a")]) == [-706]
        assert store.is_exist(key("a")) == 1
        reader.release([lease])
    assert store.remove(key("a")) == 0 and store.is_exist(key("a")) == 0


def test_force_remove_ends_the_lease(cluster, store, key):
    assert store.put(key("a"), b"leased") == 0
    with cluster.client() as reader:
        assert reader.read_begin([key("a")])[0] is not None
        assert store.remove(key("a"), force=True) == 0
    assert store.is_exist(key("a")) == 0


def test_invalid_arguments_are_minus_600(store, key):
    m = Mem(16)
    assert store.put(key("e"), b"") == mc.INVALID_PARAMS == -600
    assert store.put("", b"x") == -600
    assert store.put_batch([key("a")], [b"1", b"2"]) == -600
    assert store.put_from(key("p"), 0, 8) == -600
    assert store.get_into(key("p"), m.ptr, 0) == -600
    assert store.batch_get_into([key("p")], [m.ptr], [1, 2]) == [-600]
    assert store.remove_by_regex("(") == -600
    assert store.is_exist(key("e")) == 0 and store.is_exist(key("p")) == 0


def test_a_buffer_too_small_is_minus_600_and_left_untouched(store, key):
    m = Mem(16)
    assert store.put(key("a"), b"0123456789") == 0
    assert store.get_into(key("a"), m.ptr, 4) == -600
    assert store.batch_get_into_multi_buffers([key("a")], [[m.ptr, m.ptr + 8]], [[4, 4]]) == [-600]
    assert m.buf.raw == bytes(16)
    assert store.get_into(key("a"), m.ptr, 10) == 10 and m.at(0, 10) == b"0123456789"


def test_out_of_space_is_minus_200(store, key):
    assert store.put(key("big"), b"x" * (64 << 20)) == mc.NO_AVAILABLE_HANDLE == -200
    config = ReplicateConfig()
    config.replica_num = 2          # one segment: two replicas cannot be placed
    assert store.put(key("two"), b"x", config) == -200
    assert store.is_exist(key("big")) == 0 and store.is_exist(key("two")) == 0


def test_return_code_of_every_error_is_stable():
    assert mc.return_code(errors.KeyNotFound()) == -704
    assert mc.return_code(errors.NoSpace()) == -200
    assert mc.return_code(errors.ObjectLeased()) == mc.return_code(errors.ObjectBusy()) == -706
    assert mc.return_code(errors.InvalidArgument()) == -600
    assert mc.return_code(errors.RequestTimeout()) == mc.RPC_FAIL
    assert mc.return_code(errors.LeaseExpired()) == mc.TRANSFER_FAIL
    assert mc.return_code(ValueError()) == mc.INTERNAL_ERROR


# --- zero copy by raw address ----------------------------------------------------

def test_put_from_and_get_into_by_address(store, key):
    src, dst = Mem(64), Mem(64)
    src.buf[:12] = b"hello world!"
    assert store.register_buffer(src.ptr, 64) == 0
    assert store.register_buffer(src.ptr + 8, 8) == -600            # overlaps
    assert store.put_from(key("a"), src.ptr, 5) == 0
    assert store.batch_put_from([key("b"), key("c")], [src.ptr + 6, src.ptr], [6, 12]) == [0, 0]
    assert store.batch_get_into([key("a"), key("none"), key("b")],
                                [dst.ptr, dst.ptr + 8, dst.ptr + 16], [8, 8, 8]) == [5, -704, 6]
    assert dst.at(0, 5) == b"hello" and dst.at(16, 6) == b"world!"
    assert store.unregister_buffer(src.ptr) == 0 and store.unregister_buffer(src.ptr) == -600


def test_multi_buffer_forms_gather_and_scatter(store, key):
    src, dst = Mem(32), Mem(32)
    src.buf[:8] = b"abcdefgh"
    assert store.batch_put_from_multi_buffers([key("m")], [[src.ptr, src.ptr + 6]], [[2, 2]]) == [0]
    assert store.get(key("m")) == b"abgh"
    assert store.batch_get_into_multi_buffers([key("m")], [[dst.ptr, dst.ptr + 10]], [[3, 3]]) == [4]
    assert dst.at(0, 3) == b"abg" and dst.at(10, 1) == b"h"
    assert store.put_parts(key("p"), b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert store.get(key("p")) == b"abcdef"


def test_buffer_handles(store, key):
    torch = pytest.importorskip("torch")
    assert store.put(key("a"), b"handle") == 0
    h = store.get_buffer(key("a"))
    assert h.size() == 6 and bytes(memoryview(h)) == b"handle"
    assert ctypes.string_at(h.ptr(), h.size()) == b"handle"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)          # read-only bytes
        assert torch.frombuffer(h, dtype=torch.uint8).tolist() == list(b"handle")
    hs = store.batch_get_buffer([key("a"), key("none")])
    assert bytes(hs[0]) == b"handle" and hs[1] is None


def test_remove_by_regex_and_remove_all_count_what_they_removed(cluster, store, key):
    for n in ("x1", "x2", "y1"):
        assert store.put(key(n), n.encode()) == 0
    assert store.remove_by_regex("^" + key("x")) == 2
    assert store.batch_is_exist([key("x1"), key("x2"), key("y1")]) == [0, 0, 1]
    with cluster.client() as c:
        assert key("y1").encode() in c.keys(page=1)
        assert c.keys(key("y").encode()) == [key("y1").encode()]
    assert store.remove_all() >= 1
    assert store.is_exist(key("y1")) == 0


# --- setup ---------------------------------------------------------------------------

def test_setup_dict_form_contributes_a_segment_that_leaves_on_close():
    with kvproto.embedded(storage_nodes=0) as cluster:
        s = MooncakeDistributedStore()
        # LMCache's spelling of the master key, Mooncake's sizes (MB = 2**20)
        assert s.setup({"local_hostname": "127.0.0.1", "metadata_server": "http://unused",
                        "global_segment_size": "16MB", "local_buffer_size": "16MB",
                        "protocol": "tcp", "master_server_address": cluster.master_address}) == 0
        assert s.get_hostname().startswith("127.0.0.1:")
        assert s.health_check() == 0
        segments = cluster.stats()["segments"]
        assert [v["capacity"] for v in segments.values() if v["live"]] == [16 << 20]
        assert s.put("k", b"v") == 0 and s.get("k") == b"v"
        assert s.setup({"master_server_addr": cluster.master_address}) == -600   # set up already
        assert s.close() == 0
        deadline = time.monotonic() + 10
        while any(v["live"] for v in cluster.stats()["segments"].values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        other = MooncakeDistributedStore()
        assert other.setup("127.0.0.1", "", 0, 0, "tcp", "",
                           cluster.master_address.removeprefix("tcp://")) == 0   # bare host:port
        assert other.get("k") == b"" and other.put("k2", b"v") == -200
        other.close()


def test_setup_refuses_bad_arguments_and_an_absent_master():
    s = MooncakeDistributedStore()
    assert s.setup({"global_segment_size": "lots", "master_server_addr": "127.0.0.1:1"}) == -600
    with pytest.raises(TypeError):
        s.setup({"a": 1}, {"b": 2})
    s.SETUP_TIMEOUT = 0.3
    assert s.setup("127.0.0.1", "", 0, 0, "tcp", "", "127.0.0.1:9") == mc.RPC_FAIL
    assert s.health_check() == mc.RPC_FAIL and s.get("k") == b"" and s.is_exist("k") == -1
    assert mc._master_address("file:///tmp/c") == "file:///tmp/c"
    assert mc._master_address("10.0.0.1:50051") == "tcp://10.0.0.1:50051"


# --- the PYTHONPATH shim -------------------------------------------------------------

@pytest.fixture
def fake_real(tmp_path):
    """A stand-in for an installed Mooncake, further along sys.path."""
    pkg = tmp_path / "mooncake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    (pkg / "store.py").write_text("class MooncakeDistributedStore:\n    real = True\n")
    (pkg / "engine.py").write_text("ENGINE = True\n")
    return str(tmp_path)


def test_shim_serves_kvproto_when_no_mooncake_is_installed(monkeypatch):
    with fresh_import([SHIM_PATH], monkeypatch, hide_real=True):
        import mooncake
        from mooncake.store import MooncakeDistributedStore as M, ReplicateConfig as R
        assert mooncake.KVPROTO_SHIM and mooncake.REAL_MOONCAKE is None
        assert M is MooncakeDistributedStore and R is ReplicateConfig


def test_shim_steps_aside_for_a_real_mooncake(monkeypatch, fake_real):
    with fresh_import([SHIM_PATH, fake_real], monkeypatch):
        with pytest.warns(RuntimeWarning, match="using the real one"):
            import mooncake
        from mooncake.store import MooncakeDistributedStore as M
        assert mooncake.REAL and M.real and not hasattr(mooncake, "KVPROTO_SHIM")


def test_shim_forced_over_a_real_mooncake_keeps_its_other_modules(monkeypatch, fake_real):
    with fresh_import([SHIM_PATH, fake_real], monkeypatch, mode="force"):
        import mooncake
        import mooncake.engine
        from mooncake.store import MooncakeDistributedStore as M
        assert M is MooncakeDistributedStore and mooncake.engine.ENGINE
        assert mooncake.REAL_MOONCAKE.startswith(fake_real)


def test_shim_refuses_an_unknown_mode(monkeypatch):
    with fresh_import([SHIM_PATH], monkeypatch, mode="yes"):
        with pytest.raises(ImportError, match="KVPROTO_MOONCAKE_SHIM"):
            import mooncake  # noqa: F401

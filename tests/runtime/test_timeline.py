"""bench/timeline.py: the message hops of a batch-1 same-host put and get,
as docs/gpu.md lists them ("Where a 4 KiB put and get spend their time").

A short run, end to end: the master, the storage node and the client each
note when they receive and send; this checks that every hop the doc names
happens, in the order it names (per call each hop follows the one before,
so their medians are ordered too). A hop removed or added by a protocol
change fails here until the doc's table is measured again."""

from __future__ import annotations

import json
import subprocess
import sys

from runtime_helpers import REPO, child_env

#: the put's hops as docs/gpu.md orders them (a chain: each after the last)
PUT_CHAIN = ["client_send_put_start", "master_recv_put_start", "master_sent_assign",
             "node_recv_assign", "client_assign_seen",
             "client_memcpy_done", "client_reported", "client_send_put_end",
             "master_recv_put_end", "master_sent_publish", "node_recv_publish",
             "node_replied_publish", "master_ack_publish", "master_replied_put_end",
             "client_reply_put_end"]
#: the grant's reply, which the assign's travel overlaps
PUT_GRANT = ["master_sent_assign", "master_replied_put_start", "client_reply_put_start",
             "client_assign_seen"]
#: a get: one round trip to the master, the copy; no storage node message
GET_CHAIN = ["client_send_read_begin", "master_recv_read_begin", "master_replied_read_begin",
             "client_reply_read_begin", "client_copy_start", "client_copy_done"]


def test_timeline_shows_the_hops_the_doc_lists(tmp_path):
    out_json = tmp_path / "timeline.json"
    run = subprocess.run([sys.executable, "bench/timeline.py", "--puts", "40",
                          "--json", str(out_json)],
                         cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(out_json.read_text())
    put = {name: t for name, t, _ in got["put"]}
    get = {name: t for name, t, _ in got["get"]}
    for chain, seen in ((PUT_CHAIN, put), (PUT_GRANT, put), (GET_CHAIN, get)):
        missing = [e for e in chain if e not in seen]
        assert not missing, f"hops not seen: {missing} (seen: {sorted(seen)})"
        times = [seen[e] for e in chain]
        assert times == sorted(times), list(zip(chain, times))
    assert not any(name.startswith("node_") for name in get), sorted(get)
    assert got["raw_rtt_us"] > 0 and {n for n, _, _ in got["put_spans"]} >= {
        "writer waits for the assign after the grant", "publish command to its ack (master)"}

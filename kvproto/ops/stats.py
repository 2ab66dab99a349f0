"""``kvproto stats``: a running cluster's figures, once or live.

Asks the master for ``stats`` and every live storage node it lists for its
own ``stats``, turns both into samples with the functions the Prometheus
collectors use (:func:`~kvproto.ops.metrics.master_samples`,
:func:`~kvproto.ops.metrics.storage_samples`), and prints one line per
sample: the metric as Prometheus names it, its value, and with ``--watch``
each counter's rate per second since the previous round. Request latencies
and the process figures exist only on the metrics endpoints.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Optional, TextIO

from kvproto import errors
from kvproto.ops import metrics as M


_ADDRESS = re.compile(r"^(tcp://\S+:\d{1,5}|ipc://\S+|file://\S+|etcd://\S+)$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", required=True,
                        help="the master's address, or the coordinator's (file:///dir, etcd://host:port) (required)")
    parser.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                        help="print again every SECONDS, with counters' rates (Ctrl-C stops; default: print once)")
    parser.add_argument("--count", type=int, default=None, metavar="N",
                        help="with --watch: stop after N rounds (default: until Ctrl-C)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each answer")
    parser.add_argument("--json", action="store_true", help="print the samples as JSON")


def node_stats(endpoint: str, timeout: float) -> dict:
    """A storage node's ``stats`` reply."""
    import zmq

    from kvproto.runtime import wire

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(endpoint)
        sock.send(wire.encode_request("stats", 1, {}))
        if not sock.poll(int(timeout * 1000)):
            raise errors.RequestTimeout(f"storage node {endpoint} did not answer stats in time")
        reply = wire.decode_reply(sock.recv_multipart(copy=False))
        return dict(reply.raise_for_status().body)
    finally:
        sock.close(linger=0)


def collect(client, timeout: float) -> dict:
    """``{"master": samples, "storage": {segment: samples}, "unreachable": {segment: why}}``."""
    master = client.stats(timeout=timeout)
    out: dict = {"master": M.master_samples(master), "storage": {}, "unreachable": {}}
    for segment, seg in sorted(master.get("segments", {}).items()):
        if not seg.get("live") or not seg.get("endpoint"):
            continue
        try:
            node = node_stats(seg["endpoint"], timeout)
        except errors.KvError as err:
            out["unreachable"][segment] = err.message
            continue
        out["storage"][segment] = M.storage_samples({**node, "endpoint": seg["endpoint"]})
    return out


def _key(name: str, labels: dict) -> str:
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{inner}}}"


def _value(v: float) -> str:
    if float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:,.6g}"


def render(round_: dict, address: str, previous: Optional[dict], elapsed: float) -> str:
    def block(title: str, samples: list, before: Optional[list]) -> list[str]:
        earlier = {_key(n, l): v for n, l, v in before or ()}
        lines = [title]
        for name, labels, value in samples:
            key = _key(name, labels)
            line = f"  {key:<64} {_value(value):>16}"
            if M.METRICS[name].kind == M.C and key in earlier and elapsed > 0:
                line += f"  {(value - earlier[key]) / elapsed:>12,.1f}/s"
            lines.append(line)
        return lines

    prev = previous or {}
    lines = block(f"master {address}", round_["master"], prev.get("master"))
    for segment, samples in round_["storage"].items():
        lines.append("")
        lines += block(f"storage {segment}", samples, prev.get("storage", {}).get(segment))
    for segment, why in round_["unreachable"].items():
        lines += ["", f"storage {segment}: {why}"]
    return "\n".join(lines)


def main(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    out = out or sys.stdout
    if args.watch is not None and args.watch <= 0:
        print("kvproto stats: --watch needs a positive number of seconds", file=sys.stderr)
        return 2
    if args.count is not None and args.count <= 0:
        print("kvproto stats: --count needs a positive number", file=sys.stderr)
        return 2
    if not _ADDRESS.match(args.master):
        print(f"kvproto stats: --master {args.master!r} is not tcp://host:port, ipc://path, "
              "file:///dir or etcd://host:port", file=sys.stderr)
        return 2
    import zmq

    from kvproto.runtime.client import Client

    try:
        client = Client(args.master, timeout=args.timeout, leases=False)
    except (errors.KvError, ValueError) as err:
        print(f"kvproto stats: {err}", file=sys.stderr)
        return 2
    previous, at, rounds = None, 0.0, 0
    try:
        while True:
            try:
                round_ = collect(client, args.timeout)
            except (errors.KvError, zmq.ZMQError) as err:
                print(f"kvproto stats: {err}", file=sys.stderr)
                return 1
            now = time.monotonic()
            if args.json:
                print(json.dumps({"master": round_["master"], "storage": round_["storage"],
                                  "unreachable": round_["unreachable"]}), file=out, flush=True)
            else:
                if previous is not None:
                    print(file=out)
                print(render(round_, args.master, previous, now - at), file=out, flush=True)
            rounds += 1
            if args.watch is None or (args.count is not None and rounds >= args.count):
                return 0
            previous, at = round_, now
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()

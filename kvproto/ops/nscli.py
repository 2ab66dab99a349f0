"""``kvproto ns``: a tenant's namespaces and their upgrade lifecycle
(spec/Tenancy.tla; docs/protocols/tenancy.md, "The upgrade lifecycle"),
against a running master started with a tenants file.

``kvproto ns ACTION --master ADDRESS [NAME]``, the tenant's token read from
``--token-file FILE`` or the ``KVPROTO_TOKEN`` environment variable (never
from the command line, where other users of the host could see it):

* ``create NAME --from PREVIOUS``: a canary upgrading the live ``PREVIOUS``
* ``prewarm NAME``, ``switch NAME``, ``route-back NAME``, ``drop NAME``
* ``list``: the namespaces the tenant owns or may read, one line each

A mistake (an unreadable token file, a refusal of the master, a master that
does not answer) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, TextIO

from kvproto import errors

TOKEN_ENV = "KVPROTO_TOKEN"
#: action -> the client's method
ACTIONS = {"create": "ns_create", "prewarm": "ns_prewarm", "switch": "ns_switch",
           "route-back": "ns_route_back", "drop": "ns_drop", "list": "ns_list"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n", 1)[1].replace("``", "")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("action", choices=list(ACTIONS), help="what to do")
    parser.add_argument("name", nargs="?", default=None,
                        help="the namespace (every action but list)")
    parser.add_argument("--master", required=True,
                        help="the master's address, or the coordinator's (required)")
    parser.add_argument("--from", dest="previous", default=None, metavar="PREVIOUS",
                        help="create: the live namespace the new one upgrades (required)")
    parser.add_argument("--token-file", default=None, metavar="FILE",
                        help=f"a file holding the tenant's token (default: ${TOKEN_ENV})")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for the master's answer (default: 5)")


def _token(args: argparse.Namespace) -> str:
    if args.token_file is not None:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise errors.InvalidArgument(f"cannot read token file {args.token_file}: "
                                         f"{getattr(e, 'strerror', None) or e}") from None
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise errors.InvalidArgument(f"no token: give --token-file FILE or set ${TOKEN_ENV}")
    return token


def _mistake(args: argparse.Namespace) -> Optional[str]:
    if args.action == "list":
        return "list takes no namespace" if args.name is not None else None
    if args.name is None:
        return f"{args.action} needs the namespace's name"
    if (args.action == "create") != (args.previous is not None):
        return ("create needs --from PREVIOUS" if args.action == "create"
                else "--from goes with create only")
    if not args.timeout > 0:
        return "--timeout must be positive"
    return None


def describe(namespaces: dict) -> list[str]:
    """One line per namespace: name, phase, what it upgrades, objects, bytes, grants."""
    lines = []
    for name, ns in sorted(namespaces.items()):
        line = f"{name}: {ns['phase']}, {ns['objects']} object(s), {ns['bytes']} bytes"
        if ns.get("previous"):
            line += f", upgrades {ns['previous']}"
        if ns.get("grants"):
            line += f", read by {', '.join(ns['grants'])}"
        lines.append(line)
    return lines


def main(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    from kvproto.runtime.client import Client
    out = out or sys.stdout
    problem = _mistake(args)
    if problem is not None:
        print(f"kvproto ns: {problem}", file=sys.stderr)
        return 2
    try:
        client = Client(args.master, token=_token(args), timeout=args.timeout,
                        lookup_timeout=args.timeout)
        try:
            if args.action == "list":
                for line in describe(client.ns_list()):
                    print(line, file=out)
                return 0
            kwargs = {"previous": args.previous} if args.action == "create" else {}
            getattr(client, ACTIONS[args.action])(args.name, **kwargs)
        finally:
            client.close()
    except errors.KvError as err:
        print(f"kvproto ns {args.action}: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(f"{args.name}: {args.action} done", file=out)
    return 0

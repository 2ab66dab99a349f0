"""``python -m kvproto``: the same as the ``kvproto`` command."""

from kvproto.cli import main

raise SystemExit(main())

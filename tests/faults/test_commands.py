"""``kvproto chaos`` and ``kvproto fuzz`` on the command line: a mistake is
one line and exit status 2; a short fuzz run passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvproto

pytestmark = pytest.mark.faults

ROOT = Path(kvproto.__file__).resolve().parent.parent


def kvproto_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "kvproto", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("args, says", [
    (["chaos", "--cells", "master-kill,bogus"], "unknown cell(s) 'bogus'"),
    (["chaos", "--minutes", "0"], "--minutes"),
    (["chaos", "--coordinator", "file:///tmp/x"], "etcd://"),
    (["chaos", "--trace", "--trace-steps", "0"], "--trace-steps"),
    (["fuzz", "--frames", "0"], "--frames"),
    (["fuzz", "--target", "client"], "--target"),
])
def test_a_mistake_is_one_line_and_status_2(args, says):
    done = kvproto_cli(*args)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr, done.stderr


def test_a_short_fuzz_run():
    done = kvproto_cli("fuzz", "--frames", "400", "--seed", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "400 frames" in done.stdout and "crashes 0, untyped errors 0" in done.stdout, done.stdout

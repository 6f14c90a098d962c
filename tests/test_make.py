"""The Makefile's commands: `make train` takes overrides, and a SIGTERM to `make test` stops the whole
test run (xdist workers and what they started), not only make."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


@needs_make
def test_make_train_passes_args_to_the_fit():
    # under `make test` the environment carries make's own variables (MAKELEVEL: "make[1]: Entering ..." lines)
    environment = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    dry_run = subprocess.run(["make", "-n", "--no-print-directory", "-o", ".venv/.installed", "train",
                              "METHOD=demo/simcse", "ARGS=--trainer.max_steps 20 --model.init_args.lr 1e-5"], cwd=REPO,
                             capture_output=True, text=True, check=True, env=environment)
    assert dry_run.stdout.strip().splitlines()[-1] == (
        ".venv/bin/sentemb fit -c experiments/demo/simcse.yaml --trainer.max_steps 20 --model.init_args.lr 1e-5")


@pytest.mark.slow  # starts a pytest session with two xdist workers
def test_sigterm_to_a_test_run_stops_its_workers_and_their_children(tmp_path):
    """A test run like `make test`'s (the session hooks tests/conftest.py uses, `-n 2`): each worker starts
    a child that would sleep for minutes; a SIGTERM to the session's process leaves none of them running."""
    pids = tmp_path / "pids"
    pids.mkdir()
    (tmp_path / "test_sleepers.py").write_text(
        "import os, subprocess, sys, time\nimport pytest\n\n"
        "@pytest.mark.parametrize('n', [0, 1])\n"
        "def test_sleeps(n):\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"    open(os.path.join({str(pids)!r}, f'{{os.getpid()}}-{{child.pid}}'), 'w').close()\n"
        "    time.sleep(600)\n"
    )
    session = subprocess.Popen([sys.executable, "-m", "pytest", "-n", "2", "-p", "tests.session", "-q",
                                "-p", "no:cacheprovider", str(tmp_path / "test_sleepers.py")],
                               cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline and session.poll() is None:
        time.sleep(0.5)
    started = [int(pid) for name in os.listdir(pids) for pid in name.split("-")]
    assert len(started) == 4, "the two workers did not start their children"
    session.send_signal(signal.SIGTERM)
    assert session.wait(timeout=60) == 128 + signal.SIGTERM
    time.sleep(0.5)
    assert [pid for pid in started if _running(pid)] == []


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

"""The hooks of the process that runs a test session, in a module that imports no torch (tests/conftest.py
uses them; tests/test_make.py loads them alone with `-p tests.session`, so its nested session starts in
seconds): a SIGTERM (`make test` stopped) takes the xdist workers and everything they started with it,
and the duration budget (tests/duration_budget.py) is reported."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tests import duration_budget


def pytest_addoption(parser: pytest.Parser) -> None:
    duration_budget.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    """Only in the process that runs the session, not in an xdist worker."""
    # `workerinput` marks an xdist worker; the environment would not: a session started from a worker
    # (tests/test_make.py) inherits its PYTEST_XDIST_WORKER
    if hasattr(config, "workerinput"):
        return
    config.pluginmanager.register(duration_budget.DurationBudget(config.getoption("test_budget"),
                                                                 config.getoption("strict_test_budget")),
                                  "duration_budget")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop_with_descendants)
        # not in a forked child (a DataLoader or tokenization worker): there the handler would stop the
        # child's own descendants only, and runs only if the signal reaches its main thread
        os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))


def stop_with_descendants(signum: int, frame: object) -> None:
    """Terminate every descendant (xdist workers, their DataLoader workers, the `sentemb` processes tests
    start), kill those still there after 5 s, then exit: orphans would go on holding memory."""
    import psutil  # a dependency of wandb

    descendants = psutil.Process().children(recursive=True)
    for process in descendants:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(descendants, timeout=5)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    os._exit(128 + signum)

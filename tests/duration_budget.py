"""The suite's time budget, reported at the end of every run: a test not marked `slow` should take at
most `--test-budget` seconds (30 by default; setup included, so a fit shared through a fixture counts
once, in the first test that uses it).

Over-budget tests are listed in a "duration budget" section beside the machine's load average; they
fail the run only with `--strict-test-budget`. A hard failure by default would make CI flaky: the
same test takes 2–4× longer on a loaded runner, so the check that decides is run on a quiet machine
(docs/install.md, "Tests").
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("duration budget")
    group.addoption("--test-budget", type=float, default=30.0, metavar="SECONDS",
                    help="longest a test not marked slow may take (setup + call; default 30)")
    group.addoption("--strict-test-budget", action="store_true",
                    help="fail the run when a test not marked slow exceeds --test-budget (default: report only)")


class DurationBudget:
    """A plugin for the process that reports (xdist's controller, or the only process)."""

    def __init__(self, budget: float, strict: bool) -> None:
        self.budget = budget
        self.strict = strict
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when in ("setup", "call") and "slow" not in report.keywords:
            self.seconds[report.nodeid] += report.duration

    def over_budget(self) -> list[tuple[float, str]]:
        return sorted(((s, nodeid) for nodeid, s in self.seconds.items() if s > self.budget), reverse=True)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.strict and self.over_budget() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.seconds:
            return
        over = self.over_budget()
        load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        if not over:
            terminalreporter.write_line(f"duration budget: no test outside `slow` took over {self.budget:g} s ({load})")
            return
        verdict = "fails the run" if self.strict else "reported, not failed (--strict-test-budget fails)"
        terminalreporter.section("duration budget", sep="-", yellow=True)
        terminalreporter.write_line(f"{len(over)} test(s) not marked slow took over {self.budget:g} s "
                                    f"({load}; {verdict}):")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:8.1f}s  {nodeid}")

"""A time budget for the test run, loaded by tests/conftest.py (or `-p tests.budget`).

When LM_TEST_BUDGET_S is set (launch/test.sh sets it: 15 minutes for the full suite, 3 for --quick), the run
ends with its 10 slowest tests and its wall time against the budget, and a run over budget exits 1 even when
every test passed: a slow test fails the run the day it lands, not months later when the whole suite has
crept past what anyone waits for. A run that already failed (failures, nothing collected, interrupted) keeps
pytest's own exit status."""

import os
import time
from collections import defaultdict

import pytest

BUDGET_ENV = "LM_TEST_BUDGET_S"
SLOWEST = 10


def budget_s() -> float | None:
    """The budget in seconds from LM_TEST_BUDGET_S, None when it is unset or empty."""
    value = os.environ.get(BUDGET_ENV, "").strip()
    if not value:
        return None
    try:
        budget = float(value)
    except ValueError:
        raise pytest.UsageError(f"{BUDGET_ENV}={value!r}: expected a number of seconds") from None
    if budget <= 0:
        raise pytest.UsageError(f"{BUDGET_ENV}={value!r}: must be > 0 seconds")
    return budget


class Budget:
    """One run's clock and per-test times; an object per run, so a pytest run inside a test keeps its own."""

    def __init__(self, budget: float):
        self.budget = budget
        self.started = time.monotonic()
        self.elapsed = 0.0
        self.spent: dict[str, float] = defaultdict(float)  # node id -> seconds in setup, call and teardown

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.spent[report.nodeid] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.elapsed = time.monotonic() - self.started
        if exitstatus == pytest.ExitCode.OK and self.elapsed > self.budget:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, exitstatus: int, config: pytest.Config) -> None:
        tr = terminalreporter
        tr.section(f"{SLOWEST} slowest tests (setup + call + teardown)")
        for nodeid, seconds in sorted(self.spent.items(), key=lambda kv: -kv[1])[:SLOWEST]:
            tr.write_line(f"{seconds:8.2f}s {nodeid}")
        line = f"test time {self.elapsed:.1f} s of a {self.budget:g} s budget ({BUDGET_ENV})"
        if self.elapsed > self.budget:
            tr.write_line(f"over budget: {line}; make the slow tests faster, or mark them for the full tier only "
                          "(docs/dev/notes.md, CI)", red=True, bold=True)
        else:
            tr.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    budget = budget_s()  # a bad value is a usage error before any test runs, not after the whole suite
    if budget is not None:
        config.pluginmanager.register(Budget(budget), "lm-test-budget")

"""The test-time budget of tests/budget.py, on small pytest runs inside this one (pytester, no process started):
a run over LM_TEST_BUDGET_S fails though every test passed, a run within it passes, and pytest's own failures
and exit 5 (nothing collected) stay what they were."""

import pytest

SLEEPS = "import time\n\ndef test_sleeps():\n    time.sleep({seconds})\n"


def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, budget: str | None) -> pytest.RunResult:
    if budget is None:
        monkeypatch.delenv("LM_TEST_BUDGET_S", raising=False)
    else:
        monkeypatch.setenv("LM_TEST_BUDGET_S", budget)
    return pytester.runpytest_inprocess("-p", "tests.budget", "-p", "no:cacheprovider")


def test_a_test_that_sleeps_past_the_budget_fails_the_run(pytester, monkeypatch):
    # the 20-minute sleep against the 15-minute budget, in seconds
    pytester.makepyfile(test_slow=SLEEPS.format(seconds=2))
    result = run(pytester, monkeypatch, "1")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1)  # every test passed: only the budget fails the run
    result.stdout.fnmatch_lines(["*10 slowest tests*", "*s test_slow.py::test_sleeps",
                                 "over budget: test time 2.* s of a 1 s budget (LM_TEST_BUDGET_S)*"])
    slowest = next(line for line in result.outlines if line.endswith("test_slow.py::test_sleeps"))
    assert float(slowest.split("s ")[0]) >= 2.0


def test_a_run_within_the_budget_passes_and_lists_its_slowest_tests(pytester, monkeypatch):
    pytester.makepyfile(**{f"test_{i}": f"def test_{i}():\n    assert {i} == {i}\n" for i in range(12)})
    result = run(pytester, monkeypatch, "600")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=12)
    result.stdout.fnmatch_lines(["*10 slowest tests*", "test time * s of a 600 s budget (LM_TEST_BUDGET_S)"])
    listed = [line for line in result.outlines if "::test_" in line and line.lstrip()[0].isdigit()]
    assert len(listed) == 10  # the 10 slowest of 12, not all
    assert "over budget" not in result.stdout.str()


def test_a_failing_run_over_budget_keeps_its_failure(pytester, monkeypatch):
    pytester.makepyfile(test_fails="def test_fails():\n    assert 1 == 2\n")
    result = run(pytester, monkeypatch, "0.001")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["over budget: *"])


def test_nothing_collected_stays_exit_5_under_a_budget(pytester, monkeypatch):
    result = run(pytester, monkeypatch, "0.001")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED


def test_without_the_variable_there_is_no_budget(pytester, monkeypatch):
    pytester.makepyfile(test_slow=SLEEPS.format(seconds=0.01))
    result = run(pytester, monkeypatch, None)
    assert result.ret == pytest.ExitCode.OK
    assert "slowest tests" not in result.stdout.str() and "LM_TEST_BUDGET_S" not in result.stdout.str()


@pytest.mark.parametrize("value", ["fifteen", "0", "-5"])
def test_a_budget_that_is_not_a_positive_number_is_a_usage_error(pytester, monkeypatch, value):
    pytester.makepyfile(test_fine="def test_fine():\n    pass\n")
    result = run(pytester, monkeypatch, value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"LM_TEST_BUDGET_S={value!r}" in result.stderr.str()

"""The skipped-step counters the trainer keeps on the device between log steps."""

import torch

from lm.training.nonfinite import SkippedSteps


def record(counter: SkippedSteps, outcomes: str) -> None:
    """Feed one step per character: 'a' applied, 's' skipped."""
    for outcome in outcomes:
        counter.add(torch.tensor(outcome == "a"))


def test_counts_skips_and_the_longest_run_between_reads():
    counter = SkippedSteps(torch.device("cpu"))
    record(counter, "asssasaa")
    assert counter.read() == (4, 3) and counter.total == 4
    record(counter, "aaaa")
    assert counter.read() == (0, 0) and counter.total == 4


def test_a_run_going_on_at_a_read_carries_into_the_next():
    counter = SkippedSteps(torch.device("cpu"))
    record(counter, "aass")
    assert counter.read() == (2, 2)
    record(counter, "ssa")
    assert counter.read() == (2, 4) and counter.total == 4
    record(counter, "s")
    assert counter.read() == (1, 1)


def test_a_run_saved_between_reads_is_still_reported_after_a_resume_that_applies_the_next_step():
    """A checkpoint taken between log steps, at the end of a run of 2 skipped steps not yet read: the resumed
    counter reports that run at its first read even when the next step is applied (the limit was reached
    before the restart, and a restart must not hide it)."""
    counter = SkippedSteps(torch.device("cpu"))
    record(counter, "ass")
    state = counter.state_dict()
    assert state == {"skipped_steps": 2, "skipped_in_a_row": 2}
    resumed = SkippedSteps(torch.device("cpu"))
    resumed.load_state_dict(state)
    record(resumed, "a")
    assert resumed.read() == (0, 2) and resumed.total == 2

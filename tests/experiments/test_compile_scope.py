"""The compile-scope measurement: each scope's row, printed; timed here for the demo preset (one 128-token
sequence on a CPU) so that compiling the two scopes takes seconds, not the minutes gpt2-124m's would."""

import pytest

from experiments import compile_scope

# torch.compile of a model on the CPU, two scopes: the full tier only
pytestmark = pytest.mark.slow


def test_each_scope_gets_a_timed_row(capsys):
    assert compile_scope.main(["--device", "cpu", "--micro", "1", "--warmup", "0", "--reps", "1",
                               "--scopes", "blocks+loss", "whole", "--preset", "demo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("blocks", "whole"))}
    assert set(rows) == {"blocks+loss", "whole"}
    for cells in rows.values():
        assert cells[1:4] == ["1", "x", "128"] and float(cells[4]) > 0  # ms/step

"""The compile-scope measurement: each scope's and mode's row, printed; timed here for the demo preset cut to one
block (one 128-token sequence on a CPU), so that compiling four rows takes seconds, not the minutes gpt2-124m's
would."""

import dataclasses

import pytest

from experiments import compile_scope


@pytest.mark.slow  # torch.compile of a model on the CPU, two scopes: the full tier only
def test_each_scope_and_mode_gets_a_timed_row(capsys, monkeypatch):
    # compile time grows with the blocks; one shows the rows as well as four. The blocks-and-loss scope is what
    # train.compile runs (tests/training/test_trainer.py, tests/models/test_compiled_loss.py)
    preset_config = compile_scope.preset_config

    def one_block(preset, device):
        cfg, micro = preset_config(preset, device)
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layer=1)), micro

    monkeypatch.setattr(compile_scope, "preset_config", one_block)
    assert compile_scope.main(["--device", "cpu", "--micro", "1", "--warmup", "0", "--reps", "1",
                               "--scopes", "blocks", "whole", "--modes", "default", "max-autotune-no-cudagraphs",
                               "--preset", "demo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {tuple(line.split()[:2]): line.split() for line in lines if line.startswith(("blocks", "whole"))}
    assert set(rows) == {(scope, mode) for scope in ("blocks", "whole")
                         for mode in ("default", "max-autotune-no-cudagraphs")}
    for cells in rows.values():
        assert cells[2:5] == ["1", "x", "128"] and float(cells[5]) > 0  # ms/step


@pytest.mark.parametrize("argv, message", [
    # the preset's config file was reported as --config, a flag the tool does not have
    (["--preset", "nosuch"], "argument --preset: invalid choice: 'nosuch' (choose from 'demo', 'demo-encdec'"),
    # -3 meant no warm-up: the compile landed in the timed median without a word
    (["--warmup", "-3"], "argument --warmup: expected an integer in [0, 10000], got '-3'"),
])
def test_bad_flags_are_named(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(compile_scope, "init_device", lambda *args: pytest.fail("the flags were taken"))
    with pytest.raises(SystemExit) as stop:
        compile_scope.main(["--device", "cpu", *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err

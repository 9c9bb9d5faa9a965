"""The loss_chunk measurement on a tiny model: a training step timed in a fresh process, its memory read, and the
table printed."""

import pytest

from experiments import losschunk
from lm.config import load_config


@pytest.mark.process
def test_a_fresh_process_times_a_step_and_reads_its_memory():
    cfg = load_config(None, ["--model.n_layer=1", "--model.n_head=2", "--model.d_model=32", "--model.block_size=32",
                             "--data.seq_len=16", "--train.device=cpu"])
    row = losschunk.measure_fresh(cfg, "cpu", 2, 48, 16, 1, 2)  # 48 > block_size: the measurement widens it
    assert row["ms/step"] > 0
    assert row["peak GiB"] > 0.05 and row["step GiB"] is not None  # the resident set on Linux


def test_the_table_lists_every_shape_and_chunk(monkeypatch, capsys):
    seen = []

    def measured(cfg, device, batch, seq_len, chunk, warmup, reps):  # the process itself is tested above
        seen.append((batch, seq_len, chunk))
        return {"ms/step": 10.0 + chunk / 100, "peak GiB": 1.0 - chunk / 4096, "step GiB": 0.5}

    monkeypatch.setattr(losschunk, "measure_fresh", measured)
    assert losschunk.main(["--device", "cpu", "--warmup", "0", "--reps", "1"]) == 0
    table = capsys.readouterr().out
    assert len(seen) == len(losschunk.SHAPES) * len(losschunk.SIZES) * losschunk.ROUNDS
    assert "0 (off)" in table and "peak / off" in table


def test_a_negative_warmup_is_refused(capsys, monkeypatch):
    # it meant no warm-up, and a compile or a cold cache in the timed median without a word
    monkeypatch.setattr(losschunk, "init_device", lambda *args: pytest.fail("the flags were taken"))
    with pytest.raises(SystemExit) as stop:
        losschunk.main(["--device", "cpu", "--warmup", "-1"])
    assert stop.value.code == 2
    assert "argument --warmup: expected an integer in [0, 10000], got '-1'" in capsys.readouterr().err

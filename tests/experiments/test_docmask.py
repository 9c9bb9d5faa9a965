"""The docmask bench on a tiny model: packed windows of several documents, both model paths timed, and
flex_attention checked against SDPA with the same document mask."""

import pytest
import torch

from experiments import docmask
from experiments.docmask import bench_attention, bench_model_paths, packed_positions
from lm.config import load_config

CPU = torch.device("cpu")


def tiny():
    return load_config(None, ["--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=64",
                              "--data.seq_len=32", "--train.device=cpu"])


def test_packed_positions_hold_several_documents_per_row():
    positions = packed_positions(3, 64)
    assert positions.shape == (3, 64) and (positions[:, 0] == 0).all()
    starts = (positions == 0).sum(dim=1)  # documents per row
    assert (starts >= 2).all() and len({tuple(row.tolist()) for row in positions}) == 3
    # inside a document positions count up by one
    steps = positions[:, 1:] - positions[:, :-1]
    assert ((steps == 1) | (positions[:, 1:] == 0)).all()
    assert torch.equal(packed_positions(3, 64), positions)  # seeded


def test_model_rows_time_both_paths_beyond_the_block_size():
    ms = bench_model_paths(tiny(), CPU, 2, 96, warmup=1, reps=1)  # 96 > block_size 64: the bench widens it
    assert ms["is_causal"] > 0 and ms["mask"] > 0


@pytest.mark.slow  # 16 s on the 2-core machine: every row of the bench, flex_attention among them
def test_attention_rows_and_flex_attention_matches_sdpa_with_the_mask():
    row = bench_attention(tiny(), CPU, 2, 64, warmup=1, reps=1)
    assert row["max |flex - mask|"] < 1e-5
    assert set(row["forward"]) == {"is_causal", "mask", "flex"}
    assert set(row["forward + backward"]) == {"is_causal", "mask"}  # torch has no CPU backward for flex
    assert row["mask build"] > 0 and row["block mask build"] > 0
    assert "flex" not in bench_attention(tiny(), CPU, 2, 64, warmup=0, reps=1, flex=False)["forward"]


def test_a_negative_warmup_is_refused(capsys, monkeypatch):
    # it meant no warm-up, and a compile or a cold cache in the timed median without a word
    monkeypatch.setattr(docmask, "init_device", lambda *args: pytest.fail("the flags were taken"))
    with pytest.raises(SystemExit) as stop:
        docmask.main(["--device", "cpu", "--warmup", "-1"])
    assert stop.value.code == 2
    assert "argument --warmup: expected an integer in [0, 10000], got '-1'" in capsys.readouterr().err

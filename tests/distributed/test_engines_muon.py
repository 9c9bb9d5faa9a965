"""optim.name=muon and optim.z_loss under ddp and fsdp on real 2-process gloo groups: the same losses as one
process (so the same Muon updates: FSDP2 orthogonalises each gathered matrix whole), exact resume at the same
world size, and a resharded resume from 2 processes to 1."""

import json

import pytest

from tests.distributed.test_engines import ENGINES, RESHARD_REL, SAME_BATCH_REL, resume_copy, train

MUON = ["--optim.name=muon", "--optim.muon_lr=0.03", "--optim.z_loss=1e-3"]


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_muon_on_two_processes_matches_one_and_resumes(engine, tiny_data_dir, tmp_path):
    flags = [*ENGINES[engine], *MUON]
    one = train(1, tmp_path / "one", tiny_data_dir, *flags)
    two = train(2, tmp_path / "two", tiny_data_dir, *flags)
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5, 6]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=SAME_BATCH_REL), step
    assert two[6] < two[1] - 0.1
    # the same world size: steps 4..6 again, bit for bit (the momentum buffers are in the checkpoint)
    again = train(2, resume_copy(tmp_path / "two", tmp_path / "again"), tiny_data_dir, *flags)
    assert sorted(again) == [4, 5, 6] and all(again[s] == two[s] for s in again)
    # 2 processes -> 1: the buffers are resharded (fsdp) or read whole (ddp) and continue the trajectory
    alone = train(1, resume_copy(tmp_path / "two", tmp_path / "alone"), tiny_data_dir, *flags)
    assert sorted(alone) == [4, 5, 6]
    for step in alone:
        assert alone[step] == pytest.approx(two[step], rel=RESHARD_REL), step


def test_the_z_loss_is_logged_apart_from_the_cross_entropy(tiny_data_dir, tmp_path):
    plain = train(1, tmp_path / "plain", tiny_data_dir, "--train.steps=2")
    with_z = train(1, tmp_path / "z", tiny_data_dir, "--train.steps=2", "--optim.z_loss=1e-2")
    rows = [json.loads(line) for line in (tmp_path / "z/metrics.jsonl").read_text().splitlines()]
    z = {r["step"]: r["train/z_loss"] for r in rows if "train/loss" in r}
    # step 1 is before any update: the same weights, so the same cross-entropy; its log Z^2 is that of a
    # near-uniform softmax over the padded vocabulary, log(50304)^2 = 117
    assert with_z[1] == plain[1]
    assert z[1] == pytest.approx(117.0, rel=0.02)
    assert "train/z_loss" not in json.loads((tmp_path / "plain/metrics.jsonl").read_text().splitlines()[0])

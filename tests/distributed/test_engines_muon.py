"""optim.name=muon and optim.z_loss under ddp and fsdp on real 2-process gloo groups: the same losses as one
process (so the same Muon updates: FSDP2 orthogonalises each gathered matrix whole), exact resume at the same
world size, and a resharded resume from 2 processes to 1."""

import json

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.distributed.test_engines import ENGINES, SAME_BATCH_REL, check_resumes, train

# every test here trains on 2-process gloo groups under torchrun: the full tier only
pytestmark = pytest.mark.process

MUON = ["--optim.name=muon", "--optim.muon_lr=0.03", "--optim.z_loss=1e-3"]


@pytest.fixture(scope="module")
def one_process(tiny_data_dir, tmp_path_factory) -> dict[int, float]:
    """MUON's losses on one process under ddp, which both engines' 2 processes must give (fsdp's own
    single-process run is the 2-to-1 resume of `check_resumes`)."""
    return train(1, tmp_path_factory.mktemp("one") / "ddp", tiny_data_dir, *ENGINES["ddp"], *MUON)


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_muon_on_two_processes_matches_one_and_resumes(engine, tiny_data_dir, tmp_path, one_process):
    flags = [*ENGINES[engine], *MUON]
    one = one_process
    two = train(2, tmp_path / "two", tiny_data_dir, *flags)
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5, 6]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=SAME_BATCH_REL), step
    assert two[6] < two[1] - 0.1
    # Muon stepped the blocks' matrices (an AdamW run would agree across ranks too): their state in the
    # checkpoint is a momentum buffer, not AdamW's moments
    saved = FileSystemReader(tmp_path / "two/checkpoints/step_00000003").read_metadata().state_dict_metadata
    qkv = [key for key in saved if key.startswith("optim.state.blocks.0.attn.") and "weight" in key]
    assert qkv and all(key.endswith(("momentum_buffer", "step")) for key in qkv), qkv
    check_resumes(two, tmp_path, tiny_data_dir, *flags)


def test_the_z_loss_is_logged_apart_from_the_cross_entropy_and_trained_on(tiny_data_dir, tmp_path):
    plain = train(1, tmp_path / "plain", tiny_data_dir, "--train.steps=2")
    with_z = train(1, tmp_path / "z", tiny_data_dir, "--train.steps=2", "--optim.z_loss=1e-2")
    rows = [json.loads(line) for line in (tmp_path / "z/metrics.jsonl").read_text().splitlines()]
    z = {r["step"]: r["train/z_loss"] for r in rows if "train/loss" in r}
    # step 1 is before any update: the same weights, so the same cross-entropy; its log Z^2 is that of a
    # near-uniform softmax over the padded vocabulary, log(50304)^2 = 117
    assert with_z[1] == plain[1]
    assert z[1] == pytest.approx(117.0, rel=0.02)
    assert with_z[2] != plain[2]  # the term's gradient changed the first update
    assert "train/z_loss" not in json.loads((tmp_path / "plain/metrics.jsonl").read_text().splitlines()[0])

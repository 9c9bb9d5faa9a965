"""The encoder under the engines on real 2-process gloo groups: masked-LM pretraining and fine-tuning give the
one-process losses, and validation's metrics do not depend on the world size."""

import json
import shutil
from pathlib import Path

import pytest

from lm.config import load_config
from lm.distributed.env import init_distributed
from lm.training.evaluate import evaluate
from lm.training.trainer import Trainer
from tests.conftest import write_rows
from tests.distributed.test_engines import ENGINES, SAME_BATCH_REL, check_resumes, resume_copy, train
from tests.workers import pool

# every test here trains on 2-process gloo groups under torchrun: the full tier only
pytestmark = pytest.mark.process

ENCODER = ["--model.arch=encoder", "--optim.lr=1e-2"]


@pytest.fixture(scope="module")
def one_process(tiny_data_dir, tmp_path_factory) -> dict[int, float]:
    """The masked-LM losses of ENCODER on one process under ddp: every engine's 2 processes compute the same steps
    (as in test_engines; fsdp's own single-process run is the 2-to-1 resume of `check_resumes`)."""
    return train(1, tmp_path_factory.mktemp("one") / "ddp", tiny_data_dir, *ENCODER, *ENGINES["ddp"])


def val_rows(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "val/loss" in r}


@pytest.mark.parametrize("engine, extra", [("ddp", []), ("fsdp", []), ("zero2", []), ("zero3", []),
                                           ("fsdp", ["--data.document_mask=true"])])
def test_masked_lm_on_two_processes_matches_one(engine, extra, tiny_data_dir, tmp_path, one_process):
    # the document mask changes the losses, so that case has a reference of its own
    one = train(1, tmp_path / "one", tiny_data_dir, *ENCODER, *ENGINES[engine], *extra) if extra else one_process
    two = train(2, tmp_path / "two", tiny_data_dir, *ENCODER, *ENGINES[engine], *extra)
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5, 6]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=SAME_BATCH_REL), step
    assert two[6] < two[1]
    val = val_rows(tmp_path / "two")
    assert all(0.0 <= row["val/accuracy"] <= 1.0 for row in val.values()) and sorted(val) == [3, 6]
    if engine == "fsdp" and not extra:
        # resumed at the same world size, steps 4..6 again bit for bit; on one process, the same trajectory
        check_resumes(two, tmp_path, tiny_data_dir, *ENCODER, *ENGINES[engine])


def test_fine_tuning_on_two_processes_matches_one(encoder_run, separable_rows, tiny_data_dir, tmp_path):
    task = write_rows(tmp_path / "lines.csv", separable_rows)
    flags = ["--model.head=classify", "--model.num_classes=2", f"--task.file={task}",
             f"--checkpoint.init_from={encoder_run}", "--train.batch_size=16", "--train.micro_batch_size=4",
             "--optim.lr=3e-3"]
    # the model keys given as the encoder was trained (lm.finetune takes them from the checkpoint itself)
    model = ["--model.arch=encoder"]
    reference = train(1, tmp_path / "ddp", tiny_data_dir, *model, *flags)
    reference_val = val_rows(tmp_path / "ddp")
    runs = {}
    for name in ("fsdp", "zero3"):
        runs[name] = losses = train(2, tmp_path / name, tiny_data_dir, *model, *flags, *ENGINES[name])
        for step in reference:
            assert losses[step] == pytest.approx(reference[step], rel=SAME_BATCH_REL), (name, step)
        for step, row in val_rows(tmp_path / name).items():
            for key in ("val/loss", "val/accuracy", "val/f1"):
                assert row[key] == pytest.approx(reference_val[step][key], rel=SAME_BATCH_REL), (name, step, key)
    # resumed from step 3 at the same world size: steps 4..6 again, bit for bit
    again = train(2, resume_copy(tmp_path / "fsdp", tmp_path / "again"), tiny_data_dir, *model, *flags,
                  *ENGINES["fsdp"])
    assert sorted(again) == [4, 5, 6] and all(again[s] == runs["fsdp"][s] for s in again)


def _val_metrics(run_dir: str, eval_batches: int) -> dict:
    """The val metrics of the checkpoint in `run_dir` (resumed, not trained further) over `eval_batches` micro-batches
    per rank, in this process (one rank, or one of a pool's)."""
    cfg = load_config(f"{run_dir}/config.yaml", [f"--train.out_dir={run_dir}", f"--train.eval_batches={eval_batches}"])
    trainer = Trainer(cfg, init_distributed("cpu"))
    try:
        return evaluate(trainer.engine, trainer.family, trainer.data, cfg, trainer.env)
    finally:
        trainer.lock.release()


def test_val_accuracy_on_two_processes_is_that_of_all_the_windows_they_scored(encoder_run, tmp_path):
    """2 ranks scoring 2 micro-batches each score the val windows one process scores in 4 (batches 0-3, rank r
    taking r, r + 2): the same weights give the same val/loss and val/accuracy, summed over both ranks."""
    run = tmp_path / "run"
    shutil.copytree(encoder_run, run)
    one = _val_metrics(str(run), 4)
    assert 0.0 < one["val/accuracy"] < 1.0
    two = [reply["value"] for reply in pool(2).run(_val_metrics, str(run), 2)]
    assert two[0] == two[1]
    assert two[0]["val/loss"] == pytest.approx(one["val/loss"], rel=1e-5)
    assert two[0]["val/accuracy"] == pytest.approx(one["val/accuracy"], rel=1e-6)

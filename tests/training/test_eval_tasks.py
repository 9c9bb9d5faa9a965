"""Downstream tasks in the training loop (train.eval_tasks): logged by name, kept in tasks.json, and the same
accuracies on 2 ranks as on 1."""

import json

import pytest

from lm.config import load_config
from lm.distributed.env import init_distributed
from lm.errors import ConfigError
from lm.training.task_eval import tasks_line
from lm.training.trainer import Trainer
from tests.distributed.test_engines import train
from tests.training.test_trainer import tiny_config

TASKS = ["--train.eval_tasks=arc_easy,winogrande", "--train.eval_tasks_limit=10", "--train.steps=3",
         "--checkpoint.every=3"]


@pytest.mark.process
def test_two_ranks_score_the_tasks_as_one_and_log_them(tiny_data_dir, tmp_path):
    rows = {}
    for nproc in (1, 2):
        out = tmp_path / f"ddp{nproc}"
        train(nproc, out, tiny_data_dir, "--parallel.engine=ddp", *TASKS)
        logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rows[nproc] = [r for r in logged if "tasks/core" in r]
        assert [r["step"] for r in rows[nproc]] == [3]  # eval_every 3, and the end
        kept = json.loads((out / "tasks.json").read_text())
        assert kept == {k: v for k, v in rows[nproc][0].items() if k.startswith("tasks/")} | {"step": 3}
        assert "step 3 | arc_easy acc " in out.with_suffix(".log").read_text()
    keys = ["tasks/arc_easy/acc", "tasks/arc_easy/acc_norm", "tasks/winogrande/acc", "tasks/winogrande/acc_norm",
            "tasks/core"]
    assert [rows[2][0][k] for k in keys] == [rows[1][0][k] for k in keys]
    assert all(round(rows[1][0][k] * 10) == rows[1][0][k] * 10 for k in keys[:4])  # counts of 10 items


@pytest.mark.parametrize("flags, message", [
    (["--train.eval_tasks=hellaswg"], "train.eval_tasks: unknown task 'hellaswg'; did you mean 'hellaswag'?"),
    (["--train.eval_tasks=piqa", "--model.arch=encoder"], "train.eval_tasks: tasks rank each choice by a next-token "
     "model's likelihood"),
    (["--train.eval_tasks=piqa", "--parallel.engine=fsdp", "--parallel.tp=2", "--model.n_head=2"],
     "train.eval_tasks: scored by whole-sequence forwards on each data-parallel rank, not yet under parallel.tp=2"),
    (["--train.eval_tasks_limit=-1"], "train.eval_tasks_limit: must be 0 or more, got -1"),
])
def test_tasks_the_loop_cannot_score_are_refused_by_the_config(flags, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--model.block_size=32", "--data.seq_len=16", *flags])
    assert message in str(err.value)


def test_tasks_are_scored_every_eval_tasks_every_steps_and_at_the_end():
    from lm.training.task_eval import TaskEvaluator

    def evaluator(*every: str) -> TaskEvaluator:
        return TaskEvaluator(load_config(None, ["--model.block_size=32", "--data.seq_len=16", "--train.eval_tasks=piqa",
                                                "--train.eval_tasks_limit=1", "--train.eval_every=2", *every]))

    own = evaluator("--train.eval_tasks_every=5")
    assert [step for step in range(1, 11) if own.due(step, last=step == 11)] == [5, 10] and own.due(11, last=True)
    assert [step for step in range(1, 7) if evaluator().due(step, last=False)] == [2, 4, 6]  # at every validation


def test_training_goes_on_in_training_mode_after_a_task_evaluation(tiny_data_dir, tmp_path):
    """The task scoring switches the model to eval mode and back: the steps after it train with dropout on."""
    trainer = Trainer(tiny_config(tiny_data_dir, tmp_path / "run", "--train.steps=2", "--train.eval_tasks=arc_easy",
                                  "--train.eval_tasks_limit=2", "--train.eval_tasks_every=1", "--train.eval_every=5",
                                  "--model.dropout=0.1"), init_distributed("cpu"))
    history = trainer.fit()
    assert [row["step"] for row in history if "tasks/core" in row] == [1, 2]
    assert all(module.training for module in trainer.engine.model.modules())


def test_the_task_line_shows_every_task_then_the_core_score():
    metrics = {"tasks/arc_easy/acc": 0.5, "tasks/arc_easy/acc_norm": 0.25, "tasks/winogrande/acc": 0.75,
               "tasks/winogrande/acc_norm": 0.125, "tasks/core": 0.1}
    assert tasks_line(metrics).format(step=7) == ("step 7 | arc_easy acc 0.5000 acc_norm 0.2500 | winogrande acc "
                                                  "0.7500 acc_norm 0.1250 | core 0.1000")

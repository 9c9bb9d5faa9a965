"""What a sweep's table reads from a run's metrics log (`lm.sweep.results`)."""

import json

from lm.sweep.results import read_result


def test_a_last_window_of_skipped_steps_leaves_the_last_loss_trained_to(tmp_path):
    rows = [{"step": 2, "tokens": 64, "elapsed_s": 1.0, "train/loss": 5.5, "train/skipped_steps": 0},
            {"step": 2, "tokens": 64, "elapsed_s": 1.5, "val/loss": 5.75},
            # every step of this window was skipped: the trainer logs no loss for it
            {"step": 4, "tokens": 128, "elapsed_s": 2.0, "train/grad_norm": float("nan"), "train/skipped_steps": 2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = read_result(tmp_path, {"optim.lr": 1e-3}, 10, "finished")
    assert (result.train_loss, result.val_loss, result.tokens, result.wall_s) == (5.5, 5.75, 128, 2.0)

"""Downstream tasks during training (train.eval_tasks): the items are read and encoded once, and each evaluation
scores them with the current weights, each data-parallel rank its share, the sums added over the ranks.

The same first train.eval_tasks_limit items every time, so the curve follows the model and not the sample.
"""

import torch

from lm.config import JobConfig
from lm.data.tasks import TaskScore, load_items, parse_tasks, task_metrics
from lm.distributed.engine import Engine
from lm.distributed.env import DistEnv
from lm.inference.choices import LogitsAt, encode_items, score_items
from lm.tokenizer import model_tokenizer


class TaskEvaluator:
    def __init__(self, cfg: JobConfig) -> None:
        train = cfg.train
        tokenizer = model_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
        limit = train.eval_tasks_limit or None
        self.tasks = {}
        for name in parse_tasks(train.eval_tasks, "train.eval_tasks"):
            items = load_items(name, limit)
            self.tasks[name] = (items, encode_items(tokenizer, items))
        self.every = train.eval_tasks_every or train.eval_every
        self.block_size, self.vocab_size = cfg.model.block_size, tokenizer.n_vocab
        self.batch_size = train.micro_batch_size

    def due(self, step: int, last: bool) -> bool:
        return step % self.every == 0 or last

    @torch.no_grad()
    def __call__(self, engine: Engine, env: DistEnv) -> dict[str, float]:
        """tasks/<task>/acc, tasks/<task>/acc_norm and tasks/core; a collective: every rank calls it."""

        def logits_at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            return engine.evaluate(lambda model, run: model.logits(run(x).flatten(0, 1)[index]))

        at: LogitsAt = logits_at
        engine.train(False)
        try:
            scores = {name: score_items(at, pairs, items, self.block_size, self.vocab_size, self.batch_size,
                                        env.device, env.dp_rank, env.dp_size)
                      for name, (items, pairs) in self.tasks.items()}
        finally:
            engine.train(True)
        if env.is_distributed:  # each rank's sums, added (float64: counts stay exact)
            sums = torch.tensor([s.as_list() for s in scores.values()], dtype=torch.float64, device=env.device)
            torch.distributed.all_reduce(sums)
            scores = {name: TaskScore.from_list(row) for name, row in zip(scores, sums.tolist())}
        return task_metrics(scores)


def tasks_line(metrics: dict[str, float]) -> str:
    """The stdout line of a task evaluation: each task's acc and acc_norm, then the core score."""
    names = [key.split("/")[1] for key in metrics if key.endswith("/acc")]
    shown = [f"{n} acc {metrics[f'tasks/{n}/acc']:.4f} acc_norm {metrics[f'tasks/{n}/acc_norm']:.4f}" for n in names]
    return "step {step} | " + " | ".join([*shown, f"core {metrics['tasks/core']:.4f}"])

"""The trainer's metrics: one logger with stdout, metrics.jsonl and TensorBoard behind it, and the window of
steps each train line sums up."""

import contextlib
import json
import logging
import time
from pathlib import Path

import torch

from lm.config import JobConfig
from lm.distributed.env import DistEnv
from lm.report.metrics import METRICS_FILE

log = logging.getLogger("lm.train")


class MetricLogger:
    """Writes scalars to stdout, <out_dir>/metrics.jsonl (its rows: `lm.report.metrics`) and optionally
    TensorBoard; only rank 0 writes."""

    def __init__(self, out_dir: str | Path, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.writer = None
        self.jsonl = open(Path(out_dir) / METRICS_FILE, "a") if enabled else None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(out_dir) / "tb"))

    def log(self, step: int, tokens: int, elapsed_s: float, metrics: dict[str, float], fmt: str) -> None:
        """`metrics` keys are namespaced (`train/loss`); `fmt` is the stdout line's format string."""
        if not self.enabled:
            return
        log.info(fmt.format(step=step, **{k.replace("/", "_"): v for k, v in metrics.items()}))
        row = {"step": step, "tokens": tokens, "elapsed_s": round(elapsed_s, 3), **metrics}
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for key, value in metrics.items():
                if value is not None:
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def log_hparams(self, hparams: dict[str, object], metric_keys: list[str]) -> None:
        """Record the run's settings in TensorBoard's hparams view, beside this run's own scalars.

        `SummaryWriter.add_hparams` would start a separate sub-run; writing the three hparams summaries to
        this writer instead lets the view show `metric_keys` (scalars this run logs) next to the settings.
        """
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        for summary in hparams_summaries(hparams, {key: 0.0 for key in metric_keys}):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    def log_text(self, tag: str, step: int, text: str) -> None:
        """A text entry in TensorBoard's text view (a generated sample, say)."""
        if self.writer is not None:
            self.writer.add_text(tag, text, step)
            self.writer.flush()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.writer is not None:
            self.writer.close()


class TrainWindow:
    """The steps since the last log line: their (2,) cross-entropy and z-loss term summed on the device over
    the applied steps (read once per line: one host sync), and their wall time spent training (`paused`
    leaves the rest out)."""

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros(2, device=device)
        self.applied = torch.zeros((), device=device)
        self.steps = 0
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, applied: torch.Tensor) -> None:
        self.loss += torch.where(applied, loss, 0.0)  # a skipped step's NaN would poison the mean
        self.applied += applied
        self.steps += 1

    @contextlib.contextmanager
    def paused(self):
        """Evaluation, sampling and saving inside the block do not count as training time."""
        paused = time.perf_counter()
        yield
        self.start += time.perf_counter() - paused

    def read(self, env: DistEnv) -> tuple[list[float], int, float]:
        """([cross-entropy, z-loss term] averaged over the window's applied steps and over ranks, steps,
        seconds); starts a new window."""
        loss = env.all_reduce_mean(self.loss / self.applied.clamp(min=1)).tolist()
        steps, seconds = self.steps, time.perf_counter() - self.start
        self.loss.zero_()
        self.applied.zero_()
        self.steps, self.start = 0, time.perf_counter()
        return loss, steps, seconds


def hparams(cfg: JobConfig, n_params: int) -> dict[str, object]:
    """The run's settings for TensorBoard's hparams view: every config key, dotted, and the parameter count."""
    flat: dict[str, object] = {"params": n_params}
    for section, values in cfg.to_dict().items():
        # TensorBoard takes scalars and text only: a list (data.mixture) is shown as its text
        flat.update({f"{section}.{key}": str(value) if isinstance(value, list) else value
                     for key, value in values.items()})
    return flat


# the val metrics the stdout line shows, in this order, when a run reports them
_VAL_SHOWN = (("val/loss", "val loss", ".4f"), ("val/ppl", "val ppl", ".2f"), ("val/accuracy", "accuracy", ".4f"),
              ("val/f1", "F1", ".4f"), ("val/mse", "MSE", ".4f"), ("val/pearson", "Pearson r", ".4f"))


def val_line(val: dict[str, float], sources: list[str]) -> str:
    """The stdout line of an evaluation, a format string for `MetricLogger.log` (the values are written in):
    loss and whichever of perplexity, accuracy, F1, MSE and Pearson's r the run reports, then each mixture
    source's loss."""
    shown = [f"{label} {'n/a' if val[key] is None else format(val[key], spec)}" for key, label, spec in _VAL_SHOWN
             if key in val]
    shown += [f"{name} {val[f'val/{name}/loss']:.4f}" for name in sources]
    return "step {step} | " + " | ".join(shown)

"""The trainer's metrics: one logger with stdout, metrics.jsonl and TensorBoard behind it, and the window of
steps each train line sums up."""

import contextlib
import json
import logging
import math
import time
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

from lm.config import JobConfig
from lm.distributed.env import DistEnv
from lm.models.terms import Reduce, Term
from lm.report.metrics import METRICS_FILE

log = logging.getLogger("lm.train")


def _open_rows(path: Path) -> TextIO:
    """`path` to append rows to; a last row an earlier process left cut short (killed mid-write, a full disk) is
    cut off first, or the next row would be written onto its end, leaving both unreadable."""
    if path.is_file():
        with open(path, "rb+") as f:
            text = f.read()
            if text and not text.endswith(b"\n"):
                f.truncate(text.rfind(b"\n") + 1)
    return open(path, "a")


class MetricLogger:
    """Writes scalars to stdout, <out_dir>/metrics.jsonl (its rows: `lm.report.metrics`) and optionally
    TensorBoard; only rank 0 writes."""

    def __init__(self, out_dir: str | Path, enabled: bool, tensorboard: bool, resumed_step: int = 0) -> None:
        """`resumed_step`: the checkpoint's step a resumed run starts after. The steps after it that an earlier
        process logged are logged again; TensorBoard drops its old events from there on (as the reader of
        metrics.jsonl drops the old rows)."""
        self.enabled = enabled
        self.writer = None
        self.jsonl = _open_rows(Path(out_dir) / METRICS_FILE) if enabled else None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # from step 1 on a fresh start too: a run that starts over (killed before its first checkpoint, or
            # checkpoint.every=0) drops the earlier process's events, as the metrics reader drops its rows
            self.writer = SummaryWriter(log_dir=str(Path(out_dir) / "tb"), purge_step=resumed_step + 1)

    def log(self, step: int, tokens: int, elapsed_s: float, metrics: dict[str, float], fmt: str) -> None:
        """`metrics` keys are namespaced (`train/loss`); `fmt` is the stdout line's format string."""
        if not self.enabled:
            return
        log.info(fmt.format(step=step, **{k.replace("/", "_"): v for k, v in metrics.items()}))
        # a non-finite value (a diverged loss) as null: NaN and Infinity are not JSON, which jq and other
        # strict readers refuse
        finite = {k: v if v is None or math.isfinite(v) else None for k, v in metrics.items()}
        row = {"step": step, "tokens": tokens, "elapsed_s": round(elapsed_s, 3), **finite}
        self.jsonl.write(json.dumps(row, allow_nan=False) + "\n")
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
    """The steps since the last log line: each loss term over the applied steps, kept on the device (read once
    per line: one host sync), the token positions they read and their wall time spent training (`paused` leaves
    the rest out)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reduces: dict[str, Reduce] = {}
        self.sums: dict[str, torch.Tensor] = {}
        """MEAN and SUM terms: their step values added over the applied steps; MAX terms: the largest"""
        self.weights: dict[str, torch.Tensor] = {}
        """MEAN terms: their weights (targets) added over the applied steps"""
        self.applied = torch.zeros((), device=device)
        self.tokens = 0
        self.start = time.perf_counter()

    def add(self, terms: dict[str, Term], applied: torch.Tensor, tokens: int) -> None:
        for name, term in terms.items():
            if name not in self.reduces:
                self.reduces[name] = term.reduce
                self.sums[name] = torch.full((), -math.inf if term.reduce is Reduce.MAX else 0.0, device=self.device)
                self.weights[name] = torch.zeros((), device=self.device)
            if term.reduce is Reduce.MAX:
                self.sums[name] = torch.maximum(self.sums[name], torch.where(applied, term.value, -math.inf))
            else:  # a skipped step's NaN would poison the mean
                self.sums[name] += torch.where(applied, term.value, 0.0)
                self.weights[name] += torch.where(applied, term.weight, 0.0)
        self.applied += applied
        self.tokens += tokens

    @contextlib.contextmanager
    def paused(self):
        """Evaluation, sampling and saving inside the block do not count as training time."""
        paused = time.perf_counter()
        yield
        self.start += time.perf_counter() - paused

    def read(self, env: DistEnv) -> tuple[dict[str, float], int, float]:
        """(each term over the window's applied steps and over ranks, token positions, seconds); starts a new
        window.

        A MEAN or SUM term is averaged over the applied steps; over ranks a MEAN term is weighted by each rank's
        weights, a SUM term added over the data-parallel ranks, a MAX term the largest. A term only some ranks
        hold (a pipeline's last stage) is taken from them. A window whose every step was skipped has no terms: a
        loss of 0 would read as a perfect model."""
        names = self.reduces
        if env.is_distributed:  # every rank reduces the same terms in the same order
            names = {}
            for held in env.all_gather_object({name: reduce.value for name, reduce in self.reduces.items()}):
                names |= {name: Reduce(value) for name, value in held.items() if name not in names}
        values = {}
        for name, reduce in names.items():
            held = name in self.sums
            if reduce is Reduce.MAX:
                local = self.sums[name] if held else torch.tensor(-math.inf, device=self.device)
            else:
                local = self.sums[name] / self.applied.clamp(min=1) if held else torch.zeros((), device=self.device)
            values[name] = local
        values = across_ranks(values, names, {name: self.weights.get(name) for name in names}, env)
        if not self.applied.item():  # the skip is the step's on every rank: so is this (after the collectives)
            values = {}
        tokens, seconds = self.tokens, time.perf_counter() - self.start
        self.__init__(self.device)
        return values, tokens, seconds


def across_ranks(values: dict[str, torch.Tensor], reduces: dict[str, Reduce],
                 weights: dict[str, torch.Tensor | None], env: DistEnv) -> dict[str, float]:
    """Each rank's value of each term combined over the ranks as its `Reduce` says (a no-op on one process)."""
    if not values:
        return {}
    if not env.is_distributed:
        return dict(zip(values, torch.stack(list(values.values())).tolist()))
    out = {}
    means = [name for name, reduce in reduces.items() if reduce is Reduce.MEAN]
    if means:
        held = torch.stack([weights[name] if weights[name] is not None else torch.zeros((), device=env.device)
                            for name in means])
        total = held.clone()
        dist.all_reduce(total)
        # each rank's share of the weight: a half on each of two ranks with as many targets, so the sum below is
        # the plain mean over ranks to the last bit
        share = torch.where(total > 0, held / total.clamp(min=1e-30), 0.0)
        mean = torch.stack([values[name] for name in means]) * share
        dist.all_reduce(mean)
        out |= dict(zip(means, mean.tolist()))
    # the ranks of a tensor- or context-parallel group hold the same values
    for reduce, op, copies in ((Reduce.SUM, dist.ReduceOp.SUM, env.tp * env.cp), (Reduce.MAX, dist.ReduceOp.MAX, 1)):
        names = [name for name, r in reduces.items() if r is reduce]
        if names:
            stacked = torch.stack([values[name] for name in names])
            dist.all_reduce(stacked, op=op)
            out |= dict(zip(names, (stacked / copies).tolist()))
    return {name: out[name] for name in reduces}


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

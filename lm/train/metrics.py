"""Training metrics: FLOPs and MFU arithmetic, and one logger with stdout and TensorBoard behind it."""

import json
import logging
import math
from pathlib import Path

import torch

from lm.models.config import ModelConfig

log = logging.getLogger("lm.train")

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets, matched against
# torch.cuda.get_device_name(); order matters where one name contains another.
PEAK_FLOPS = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("V100", 125e12),
]


def flops_per_token(cfg: ModelConfig, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward + backward) plus attention scores.

    `num_params` excludes position embeddings (no matmul) but counts the tied output head. The
    attention term 12 * n_layer * d_model * seq_len covers QK^T and AV in forward and backward
    (the PaLM appendix B estimate), counted for full rather than causal attention. An LSTM has no
    attention: every weight, its gates' and the head's, is used once per token, so 6 per parameter is all.
    """
    attention = 0 if cfg.arch == "lstm" else 12 * cfg.n_layer * cfg.d_model * seq_len
    return 6 * num_params + attention


def encdec_flops_per_token(model: torch.nn.Module, seq_len: int, source_len: int, target_len: int) -> float:
    """Training FLOPs per window token of an encoder-decoder fed (source_len, target_len) per window.

    Per sample: 6 per parameter per token it touches (encoder blocks on the source tokens; decoder
    blocks and the output head on the target tokens) plus the attention scores, 12 * n_layer * d_model
    times (S^2 encoder + T^2 decoder + T*S cross). Divided by the seq_len tokens the sample was cut
    from, so tokens/s and MFU compare with the GPT's at the same data rate.
    """
    cfg = model.cfg
    count = lambda modules: sum(p.numel() for m in modules for p in m.parameters())  # noqa: E731
    encoder = count([*model.encoder, model.enc_norm])
    decoder = count([*model.decoder, model.dec_norm]) + model.lm_head.weight.numel()
    S, T = source_len, target_len
    per_sample = 6 * (encoder * S + decoder * T) + 12 * cfg.n_layer * cfg.d_model * (S * S + T * T + T * S)
    return per_sample / seq_len


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of a known GPU, or None (CPUs and unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS:
        if key in name:
            return value
    return None


def perplexity(loss: float) -> float:
    """exp(loss), saturating instead of overflowing for a diverged run."""
    return math.exp(loss) if loss < 700 else math.inf


class MetricsError(ValueError):
    """A run's metrics log is missing or unreadable; the message names the file."""


class MetricLogger:
    """Writes scalars to stdout, <out_dir>/metrics.jsonl and optionally TensorBoard; only rank 0 writes.

    Each metrics.jsonl line is one JSON object: `step`, `tokens` (trained so far), `elapsed_s` (wall
    seconds of training so far, carried over resumes) and the namespaced scalars (`train/loss`, ...).
    """

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


METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of <run_dir>/metrics.jsonl as the run's final history.

    A run resumed from a checkpoint logs again the steps after that checkpoint; the later row supersedes:
    a row of step s drops every earlier row of the same kind (train or val) at step >= s.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise MetricsError(f"{path}: no metrics log; is {run_dir} a training run directory (train.out_dir)?")
    rows: list[dict] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise MetricsError(f"{path}:{number}: not a JSON object ({err.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise MetricsError(f"{path}:{number}: expected a JSON object with an integer 'step'")
        kind = row_kind(row)
        rows = [r for r in rows if row_kind(r) != kind or r["step"] < row["step"]]
        rows.append(row)
    if not rows:
        raise MetricsError(f"{path}: the metrics log is empty; the run has not logged a step yet")
    return rows


def row_kind(row: dict) -> str:
    """'val' for a validation row, 'train' otherwise: the namespace of its scalars."""
    return "val" if any(key.startswith("val/") for key in row) else "train"

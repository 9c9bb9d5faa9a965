"""The training loop: one optimizer step per global batch, logging, validation and checkpoints."""

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from lm import checkpoint as ckpt
from lm.config import ConfigError, JobConfig, save_config
from lm.data.loader import SplitWindows, TokenLoader, val_batches
from lm.data.shards import DataError, check_manifest, read_manifest, verify_hashes
from lm.distributed import DistEnv
from lm.distributed.engine import autocast_for, build_engine
from lm.models.factory import build_model
from lm.data.objectives import build_objective
from lm.runtime import tune_cpu
from lm.tokenizer import load_tokenizer
from lm.train.faults import Faults, TrainingError
from lm.train.nonfinite import SkippedSteps
from lm.train.preemption import StopSignals
from lm.train.metrics import MetricLogger, encdec_flops_per_token, flops_per_token, peak_flops, perplexity
from lm.train.samples import sample_text
from lm.train.schedule import lr_at

log = logging.getLogger("lm.train")


class Trainer:
    """Owns the model, optimizer, loader and run directory of one training job."""

    def __init__(self, cfg: JobConfig, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        if cfg.train.batch_size % (cfg.train.micro_batch_size * env.world_size):
            raise ConfigError(
                f"train.batch_size: {cfg.train.batch_size} is not a multiple of train.micro_batch_size "
                f"({cfg.train.micro_batch_size}) x world size ({env.world_size})"
            )
        manifest = read_manifest(cfg.data.dir)  # shard sizes, on every rank
        check_manifest(manifest, cfg.data.tokenizer, cfg.model.vocab_size, cfg.data.dir)
        if cfg.data.verify_hashes:
            self._verify_data(manifest)
        self.data_identity = ckpt.data_identity(manifest)
        self.out_dir = Path(cfg.train.out_dir)
        self.ckpt_root = ckpt.checkpoint_root(self.out_dir)
        resume_from = self._find_resume()

        if env.device.type == "cpu":
            tune_cpu()
        # span corruption checks its sentinel budget against seq_len here, before any weights exist
        self.objective = build_objective(cfg.model, cfg.data.seq_len, cfg.train.seed)
        load_universal = False
        if resume_from is not None:
            ckpt.check_compatible(resume_from, cfg)
            ckpt.check_data(resume_from, manifest, cfg)
            load_universal = ckpt.check_engine(resume_from, cfg, env.world_size)
            if load_universal:
                ckpt.ensure_universal(resume_from, env)
        init_from = None
        if resume_from is None and cfg.checkpoint.init_from:
            init_from = Path(cfg.checkpoint.init_from)
            ckpt.check_init_from(init_from, cfg)
        torch.manual_seed(cfg.train.seed)
        self.engine = build_engine(cfg, env, load_universal, init_from)
        self.model = self.engine.model
        self.loader = TokenLoader(
            cfg.data.dir, "train", cfg.data.seq_len, cfg.train.seed, env.rank, env.world_size,
            cfg.train.batch_size, cfg.train.micro_batch_size, self.objective,
        )
        self.val_windows = SplitWindows(cfg.data.dir, "val", cfg.data.seq_len)
        self.step = 0
        self.tokens_seen = 0
        self.elapsed_before = 0.0  # wall seconds trained by earlier processes of this run (before a resume)
        self.fit_started: float | None = None
        if resume_from is not None:
            state = ckpt.load_checkpoint(resume_from, self.engine, env)
            self.step, self.tokens_seen = state["step"], state["tokens_seen"]
            self.elapsed_before = state.get("elapsed_s", 0.0)  # absent in checkpoints from before it was kept
            self.loader.load_state_dict({"position": state["position"]})
            log.info("resumed from %s at step %d", resume_from, self.step)
            for key, (old, new) in changed_settings(resume_from, cfg).items():
                log.info("config changed since the checkpoint: %s %r -> %r", key, old, new)
        self.faults = Faults.from_env()
        self.skipped = SkippedSteps(env.device)

        # counted on a meta-device twin: sharded engines (ZeRO-3, FSDP) hide the full shapes
        with torch.device("meta"):
            shape_model = build_model(cfg.model)
        n_params = shape_model.num_params()
        if cfg.model.arch == "encdec":
            self.flops_per_token = encdec_flops_per_token(shape_model, cfg.data.seq_len, *self.objective.lengths)
        else:
            self.flops_per_token = flops_per_token(cfg.model, n_params, cfg.data.seq_len)
        self.peak_flops = peak_flops(env.device)
        if env.is_main:
            probe_output_dir(self.out_dir, checkpoint_bytes=12 * n_params)
            save_config(cfg, self.out_dir / "config.yaml")
            log.info("model: %.2fM parameters (non-embedding), %d ranks on %s, engine %s",
                     n_params / 1e6, env.world_size, env.device, self.engine.name)
        self.n_params = n_params
        self.metrics = MetricLogger(self.out_dir, env.is_main, cfg.log.tensorboard)
        self.tokenizer = load_tokenizer(cfg.data.tokenizer) if cfg.log.sample_every else None

    def _verify_data(self, manifest: dict) -> None:
        """data.verify_hashes: rank 0 hashes every shard and tells the others, so all ranks fail together."""
        error = None
        if self.env.is_main:
            try:
                verify_hashes(self.cfg.data.dir, manifest)
            except DataError as err:
                error = str(err)
        error = self.env.broadcast_object(error)
        if error is not None:
            raise DataError(error)
        log.info("%s: every shard matches its sha256 in the manifest", self.cfg.data.dir)

    def _find_resume(self) -> Path | None:
        mode = self.cfg.checkpoint.resume
        found = ckpt.complete_checkpoints(self.ckpt_root)
        if mode == "required" and not found:
            raise ckpt.CheckpointError(
                f"checkpoint.resume=required, but {self.ckpt_root} holds no complete checkpoint"
            )
        if mode == "never" and found:
            raise ckpt.CheckpointError(
                f"checkpoint.resume=never, but {self.ckpt_root} already holds checkpoints that a new "
                "run would overwrite; pick another train.out_dir or use checkpoint.resume=auto"
            )
        # the newest checkpoint whose files match its manifest; corrupt ones are skipped with a warning
        return ckpt.latest_valid_checkpoint(self.ckpt_root, self.env) if found and mode != "never" else None

    def fit(self) -> list[dict]:
        """Train to `train.steps` (or until SIGTERM/SIGINT: then save and return); returns the logged
        metrics, one dict per log step."""
        cfg, env = self.cfg, self.env
        history: list[dict] = []
        tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
        if self.step >= cfg.train.steps:
            log.info("%s is already at step %d of train.steps=%d: nothing to train", self.out_dir, self.step,
                     cfg.train.steps)
        self.fit_started = time.perf_counter()
        self.metrics.log_hparams(hparams(cfg, self.n_params), ["train/loss", "val/loss", "val/ppl", "perf/tokens_per_s"])
        window_start, window_steps = time.perf_counter(), 0
        # summed on the device over the applied steps since the last log line, and read once per line
        window_loss = torch.zeros((), device=env.device)
        window_applied = torch.zeros((), device=env.device)
        with StopSignals() as signals:
            while self.step < cfg.train.steps:
                lr = lr_at(self.step, cfg.optim.lr, cfg.schedule, cfg.train.steps)
                self.engine.set_lr(lr)
                loss, grad_norm, applied = self._train_step()
                self.step += 1
                self.tokens_seen += tokens_per_step
                self.skipped.add(applied)
                window_steps += 1
                window_loss += torch.where(applied, loss, 0.0)  # a skipped step's NaN would poison the mean
                window_applied += applied
                last = self.step == cfg.train.steps
                log_step = self.step % cfg.log.every == 0 or last
                # read at log steps: the other engines skip a non-finite step on the device, so it can wait;
                # DeepSpeed cannot skip one (and already waited for its norm, a Python float): every step
                if log_step or self.engine.name == "deepspeed":
                    self._check_nonfinite()
                if log_step:
                    # The mean over the steps since the last log line, and over ranks: one host sync per line.
                    loss_value = env.all_reduce_mean(window_loss / window_applied.clamp(min=1)).item()
                    elapsed = time.perf_counter() - window_start
                    tok_s = window_steps * tokens_per_step / elapsed
                    flops_s = self.flops_per_token * tok_s / env.world_size
                    row = {
                        "train/loss": loss_value, "train/ppl": perplexity(loss_value), "train/lr": lr,
                        "train/grad_norm": grad_norm.item(), "train/skipped_steps": self.skipped.total,
                        "perf/tokens_per_s": tok_s, "perf/tflops_per_device": flops_s / 1e12,
                        "perf/mfu": flops_s / self.peak_flops if self.peak_flops else None,
                    }
                    perf = f"mfu {row['perf/mfu']:.1%}" if self.peak_flops else f"{flops_s / 1e12:.3f} TFLOP/s"
                    skipped = f" | {self.skipped.total} skipped" if self.skipped.total else ""
                    self.metrics.log(self.step, self.tokens_seen, self.elapsed_s(), row, (
                        f"step {{step}}/{cfg.train.steps} | loss {{train_loss:.4f}} | ppl {{train_ppl:.1f}} | "
                        f"lr {{train_lr:.2e}} | grad norm {{train_grad_norm:.3f}} | {{perf_tokens_per_s:,.0f}} tok/s | "
                        f"{perf}{skipped}"
                    ))
                    history.append({"step": self.step, **row})
                    window_start, window_steps = time.perf_counter(), 0
                    window_loss.zero_()
                    window_applied.zero_()
                paused = time.perf_counter()
                if self.step % cfg.train.eval_every == 0 or last:
                    val_loss = self.evaluate()
                    val = {"val/loss": val_loss, "val/ppl": perplexity(val_loss)}
                    self.metrics.log(self.step, self.tokens_seen, self.elapsed_s(), val,
                                     "step {step} | val loss {val_loss:.4f} | val ppl {val_ppl:.2f}")
                    history.append({"step": self.step, **val})
                if cfg.log.sample_every and (self.step % cfg.log.sample_every == 0 or last):
                    self.log_sample()
                saved = self.step % cfg.checkpoint.every == 0 or last
                if saved:
                    self.save()
                self.faults.maybe_kill(self.step, env.rank)
                # every rank must stop at the same step, though a signal may reach only some of them; they
                # agree at log steps only, so the step itself stays free of this collective and host sync
                if not last and self.step % cfg.log.every == 0 and self._stop_agreed(signals):
                    if not saved:
                        self.save()
                    log.warning("stopped at step %d by %s; checkpoint saved, the same command resumes",
                                self.step, signals.requested or "a signal to another rank")
                    break
                window_start += time.perf_counter() - paused  # throughput counts training time only
        self.metrics.close()
        return history

    def elapsed_s(self) -> float:
        """Wall seconds this run has trained, over every process that resumed it (evaluations included)."""
        return self.elapsed_before + (time.perf_counter() - self.fit_started if self.fit_started else 0.0)

    def log_sample(self) -> None:
        """Continue log.sample_prompt with the current weights; rank 0 logs the text (every rank samples)."""
        # A GPT or LSTM samples through forward, where FSDP and ZeRO-3 gather each block as in training; an
        # encoder-decoder's encode and decode bypass those hooks, so its whole weights are gathered first.
        # autocast: a bf16 FSDP forward meets a cache of the weights' dtype. Eager: compiled blocks would
        # compile again for every cache length.
        gathered = self.engine.full_weights() if self.cfg.model.arch == "encdec" else contextlib.nullcontext()
        with gathered, autocast_for(self.cfg, self.env.device), torch.compiler.set_stance("force_eager"):
            text = sample_text(self.model, self.cfg, self.tokenizer, self.env.device)
        self.metrics.log_text("sample", self.step, text)
        if self.env.is_main:
            log.info("step %d | sample: %r", self.step, text)

    def _stop_agreed(self, signals: StopSignals) -> bool:
        """Whether any rank received a stop signal (a collective: every rank must call it at the same step)."""
        flag = torch.tensor(float(signals.requested is not None), device=self.env.device)
        return self.env.all_reduce_mean(flag).item() > 0

    def _check_nonfinite(self) -> None:
        """Read the skipped-step counters (one host sync) and stop after too many non-finite steps in a row."""
        new, longest = self.skipped.read()
        if new:
            log.warning("step %d: %d optimizer steps skipped since the last check for a NaN/inf loss or gradient "
                        "norm (%d in all)", self.step, new, self.skipped.total)
        # DeepSpeed has already applied the step, so its weights may no longer be finite: stop at once
        limit = 1 if self.engine.name == "deepspeed" else self.cfg.train.max_nonfinite_steps
        if longest >= limit:
            found = ckpt.complete_checkpoints(self.ckpt_root)
            last_good = found[-1] if found else "none (no checkpoint was saved)"
            raise TrainingError(
                f"step {self.step}: {longest} steps in a row with a non-finite loss or gradient "
                f"norm (train.max_nonfinite_steps={self.cfg.train.max_nonfinite_steps}); the last good "
                f"checkpoint is {last_good}. Lower optim.lr or raise optim.grad_clip, then resume from it"
            )

    def _train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward/backward over this rank's micro-batches, clip, step. Returns the mean loss, the grad norm
        and whether the optimizer step was applied (not skipped for a non-finite norm), all 0-dim tensors."""
        micro_batches = self.loader.next_batch()
        poison = self.faults.nan_at(self.step + 1, self.env.rank)
        loss_sum = torch.zeros((), device=self.env.device)
        # a copy from pinned memory is asynchronous; from pageable memory non_blocking would still wait
        pin = self.env.device.type == "cuda"
        for i, batch in enumerate(micro_batches):
            # (x, y) for the GPT, (src, tgt_in, tgt_out) for the encoder-decoder: the model's own arguments
            batch = [(t.pin_memory() if pin else t).to(self.env.device, non_blocking=True) for t in batch]
            loss_sum += self.engine.forward_backward(batch, last=i == len(micro_batches) - 1,
                                                     num_micro=len(micro_batches), poison=poison)
        grad_norm, applied = self.engine.optimizer_step()
        return loss_sum / len(micro_batches), grad_norm, applied

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over `train.eval_batches` micro-batches per rank, averaged over ranks."""
        cfg, env = self.cfg, self.env
        self.engine.train(False)
        total = torch.zeros((), device=env.device)
        count = 0
        for batch in val_batches(self.val_windows, cfg.train.micro_batch_size, env.rank, env.world_size,
                                 cfg.train.eval_batches, self.objective):
            total += self.engine.eval_loss([t.to(env.device) for t in batch]).float()
            count += 1
        self.engine.train(True)
        mean = total / max(count, 1)
        return env.all_reduce_mean(mean).item()

    def save(self) -> Path:
        """Checkpoint the run; refuses weights that are no longer finite, and reports a failed write
        (a full disk, say) with the previous checkpoint named, which the failed save leaves intact."""
        flag = torch.tensor(float(not self.engine.parameters_finite()), device=self.env.device)
        if self.env.all_reduce_mean(flag).item() > 0:
            found = ckpt.complete_checkpoints(self.ckpt_root)
            raise TrainingError(f"step {self.step}: the weights hold NaN or inf values and are not saved; the last "
                                f"good checkpoint is {found[-1] if found else 'none'}")
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed_s(),
                 **self.loader.state_dict(), "data": self.data_identity}
        self.faults.arm_save(self.engine, self.step, self.env.rank)
        try:
            return ckpt.save_checkpoint(self.ckpt_root, self.step, self.engine, state, self.cfg, self.env,
                                        self.cfg.checkpoint.keep)
        except OSError as err:
            found = ckpt.complete_checkpoints(self.ckpt_root)
            raise ckpt.CheckpointError(
                f"{self.ckpt_root}: saving step {self.step} failed ({err.strerror or err}); the previous "
                f"checkpoint {found[-1] if found else '(none)'} is intact"
            ) from None


def probe_output_dir(out_dir: Path, checkpoint_bytes: int) -> None:
    """Fail before training, not at the first save, when train.out_dir cannot be written or lacks the space
    for about one checkpoint (`checkpoint_bytes`: weights plus AdamW's two moments, 12 bytes a parameter)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".write_probe"
        with open(probe, "wb") as f:
            f.write(b"lm")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
        free = shutil.disk_usage(out_dir).free
    except OSError as err:
        raise ckpt.CheckpointError(f"train.out_dir: cannot write to {out_dir}: {err.strerror or err}") from None
    if free < checkpoint_bytes:
        raise ckpt.CheckpointError(f"train.out_dir: {out_dir} has {free / 2**20:,.0f} MiB free, less than one "
                                   f"checkpoint needs (about {checkpoint_bytes / 2**20:,.0f} MiB)")


def hparams(cfg: JobConfig, n_params: int) -> dict[str, object]:
    """The run's settings for TensorBoard's hparams view: every config key, dotted, and the parameter count."""
    flat: dict[str, object] = {"params": n_params}
    for section, values in cfg.to_dict().items():
        flat.update({f"{section}.{key}": value for key, value in values.items()})
    return flat


def changed_settings(checkpoint: Path, cfg: JobConfig) -> dict[str, tuple[object, object]]:
    """Config keys outside `model` whose value differs from the checkpoint's: {"optim.lr": (old, new)}."""
    saved, current = ckpt.read_config(checkpoint).to_dict(), cfg.to_dict()
    return {f"{section}.{key}": (saved[section][key], value)
            for section, values in current.items() if section != "model"
            for key, value in values.items() if saved[section][key] != value}

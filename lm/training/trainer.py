"""The training loop: one optimizer step per global batch, logging, validation and checkpoints.

The trainer asks the model's family (`lm.models.family`) what differs by model, and the engine what differs by
kind of parallelism; `lm.training.setup` puts the run together before the first step.
"""

import functools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from lm.checkpoint.resume import changed_settings, load_checkpoint
from lm.checkpoint.run_dir import check_run_paths, lock_run_dir, probe_output_dir
from lm.checkpoint.store import BackgroundSaves, checkpoint_root
from lm.config import JobConfig, save_config
from lm.distributed.env import DistEnv
from lm.errors import TrainingError
from lm.hf.importing import is_hf_checkpoint, keep_origin
from lm.io import atomic_write_text
from lm.models.registry import family_of
from lm.plan.counts import flops_per_token, num_params, params_outside_embeddings
from lm.plan.flops import peak_flops
from lm.report.metrics import perplexity
from lm.tokenizer import load_tokenizer
from lm.training.evaluate import evaluate
from lm.training.logger import MetricLogger, TrainWindow, hparams, val_line
from lm.training.nonfinite import SkippedSteps
from lm.training.preemption import StopSignals
from lm.training.samples import periodic_sample
from lm.training.save import last_good, save_run
from lm.training.schedule import lr_at
from lm.training.setup import build_run_engine, choose_start, open_data
from lm.training.step import Step, train_step
from lm.training.task_eval import TaskEvaluator, tasks_line
from lm.training.token_data import to_device

log = logging.getLogger("lm.train")
TASKS_FILE = "tasks.json"
"""In the run directory: the latest train.eval_tasks results, with their step"""


class Trainer:
    """Owns the model, optimizer, loader and run directory of one training job."""

    def __init__(self, cfg: JobConfig, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        self.family = family_of(cfg.model)
        self.after_step: list[Callable[[int], object]] = []
        """Called with the step number once each step is done (evaluated, sampled, saved when due)."""
        check_run_paths(cfg)
        self.out_dir = Path(cfg.train.out_dir)
        self.ckpt_root = checkpoint_root(self.out_dir)
        saves_async = cfg.checkpoint.async_ and cfg.checkpoint.every > 0  # no host copy for a run that never saves
        self.background = BackgroundSaves(self.ckpt_root, env) if saves_async else None
        self.save_seconds: list[float] = []
        """How long each save held training up (checkpoint.async: the copy to host memory, and any wait for the
        previous write)"""
        # held until fit() ends; released at once if setting up fails, so a refused run leaves no trace
        self.lock = lock_run_dir(self.out_dir, env)
        try:
            self._set_up()
        except BaseException:
            self.lock.release()
            raise

    def _set_up(self) -> None:
        """Everything after the lock is taken: data, resume, engine, counters, config."""
        cfg, env = self.cfg, self.env
        self.data = open_data(cfg, env)
        start = choose_start(cfg, env, self.ckpt_root, self.data.identity())
        self.engine = build_run_engine(cfg, self.family, env, start.load_weights, start.load_universal)
        self.model = self.engine.model
        self.loss = functools.partial(self.family.training.loss, optim=cfg.optim)
        self.loader = self.data.loader
        self.step, self.tokens_seen = 0, 0
        self.elapsed_before = 0.0  # wall seconds trained by earlier processes of this run (before a resume)
        self.fit_started: float | None = None
        self.skipped = SkippedSteps(env.device)
        if start.resume_from is not None:
            self._resume(start.resume_from)
        if env.is_main and self.step < cfg.train.steps:  # a finished run is left as it is
            probe_output_dir(cfg)
            save_config(cfg, self.out_dir / "config.yaml")
            if start.resume_from is None and cfg.checkpoint.init_from and is_hf_checkpoint(cfg.checkpoint.init_from):
                keep_origin(cfg.checkpoint.init_from, self.out_dir)
        self.n_params = num_params(cfg.model, non_embedding=True)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len, cfg.data)
        self.peak_flops = peak_flops(env.device)
        if env.is_main:
            layout = ""
            if max(env.tp, env.pp, env.cp, env.dp_replicate) > 1:
                # what this rank holds, read off the built model: the layout's split, not the config's wish
                held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in self.model.parameters())
                layout = (f" (pipeline {env.pp} x data-parallel {env.dp_size} in {env.dp_replicate} HSDP group(s) "
                          f"x context-parallel {env.cp} x tensor-parallel {env.tp}; rank 0 holds {held:,} of "
                          f"{num_params(cfg.model):,} parameters)")
            active = num_params(cfg.model, active=True)
            log.info("model: %.2fM parameters (%s%.2fM outside the embeddings), %d ranks%s on %s, engine %s",
                     num_params(cfg.model) / 1e6,
                     f"{active / 1e6:.2f}M active per token, " if active != num_params(cfg.model) else "",
                     params_outside_embeddings(cfg.model) / 1e6, env.world_size, layout, env.device, self.engine.name)
        # a family that writes no text (an encoder) has no periodic samples, whatever log.sample_every says
        generates = self.family.sampler is not None
        self.samples = bool(cfg.log.sample_every) and generates and env.tp == env.pp == env.cp == 1
        if cfg.log.sample_every and max(env.tp, env.pp, env.cp) > 1 and env.is_main:
            log.info("no periodic samples under parallel.tp, pp or cp > 1 (a split model decodes no single "
                     "tokens yet); sample from a checkpoint with lm.sample")
        self.tokenizer = load_tokenizer(cfg.data.tokenizer) if self.samples else None
        self.tasks = TaskEvaluator(cfg) if cfg.train.eval_tasks else None

    def _resume(self, path: Path) -> None:
        """Load the engine's state, this rank's RNG and the run's counters from the checkpoint `path`."""
        state = load_checkpoint(path, self.engine, self.env)
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.elapsed_before = state.get("elapsed_s", 0.0)  # absent in checkpoints from before it was kept
        self.loader.load_state_dict({"position": state["position"]})
        self.skipped.load_state_dict(state)
        log.info("resumed from %s at step %d", path, self.step)
        for key, (old, new) in changed_settings(path, self.cfg).items():
            log.info("config changed since the checkpoint: %s %r -> %r", key, old, new)

    def fit(self, signals: StopSignals | None = None) -> list[dict]:
        """Train to `train.steps` (or until SIGTERM/SIGINT: then save and return); returns the logged
        metrics, one dict per log step. `signals`: stop requests caught since before the trainer was built
        (lm.train's), else fit catches its own. The run directory's lock is released when it returns or fails."""
        try:
            if signals is not None:
                return self._fit(signals)
            with StopSignals() as own:
                return self._fit(own)
        finally:
            if self.background is not None:  # a run that failed still publishes the checkpoint being written
                self.background.close()
            self.lock.release()

    def _fit(self, signals: StopSignals) -> list[dict]:
        cfg = self.cfg
        history: list[dict] = []
        if self.step >= cfg.train.steps:
            log.info("%s is already at step %d of train.steps=%d: nothing to train", self.out_dir, self.step,
                     cfg.train.steps)
            return history
        self.metrics = MetricLogger(self.out_dir, self.env.is_main, cfg.log.tensorboard, self.step)
        self.fit_started = time.perf_counter()
        tasks = [f"tasks/{name}/acc" for name in self.tasks.tasks] + ["tasks/core"] if self.tasks else []
        self.metrics.log_hparams(hparams(cfg, self.n_params),
                                 ["train/loss", "val/loss", "val/ppl", "perf/tokens_per_s", *tasks])
        window = TrainWindow(self.env.device)
        while self.step < cfg.train.steps:
            lr = lr_at(self.step, cfg.optim.lr, cfg.schedule, cfg.train.steps)
            step = self._train_step(lr)
            self.step += 1
            self.tokens_seen += self.loader.step_tokens
            self.skipped.add(step.applied)
            window.add(step.terms, step.applied, self.loader.step_tokens)
            last = self.step == cfg.train.steps
            log_step = self.step % cfg.log.every == 0 or last
            # read at log steps when the engine skips a non-finite step on the device, so it can wait; one that
            # cannot skip it (DeepSpeed, which already waited for its norm, a Python float): every step
            if log_step or not self.engine.skips_nonfinite:
                self._check_nonfinite()
            if log_step:
                history.append(self._log_train(window, lr, step.grad_norm))
            with window.paused():
                stop = self._after_step(last, signals, history)
            if stop:
                break
        if self.background is not None:  # the run ends once its last checkpoint is complete
            self.background.wait()
        self.metrics.close()
        return history

    def _after_step(self, last: bool, signals: StopSignals, history: list[dict]) -> bool:
        """Evaluate, sample and save when due; whether the run stops here for a signal (saved first)."""
        cfg = self.cfg
        if self.background is not None:
            self.background.allocate(self.engine)  # after the run's first step, once
        if self.step % cfg.train.eval_every == 0 or last:
            val = evaluate(self.engine, self.family, self.data, cfg, self.env)
            sources = [s.name for s in self.data.sources] if self.data.is_mixture else []
            self.metrics.log(self.step, self.tokens_seen, self.elapsed_s(), val, val_line(val, sources))
            history.append({"step": self.step, **val})
        if self.tasks is not None and self.tasks.due(self.step, last):
            self._evaluate_tasks(history)
        if self.samples and (self.step % cfg.log.sample_every == 0 or last):
            self.log_sample()
        every = cfg.checkpoint.every
        saved = every > 0 and (self.step % every == 0 or last)
        if saved:
            self.save()
        for hook in self.after_step:
            hook(self.step)
        # every rank must stop at the same step, though a signal may reach only some of them; they agree at
        # log steps only, so the step itself stays free of this collective and host sync
        if last or self.step % cfg.log.every or not self._stop_agreed(signals):
            return False
        if every == 0:
            if self.env.is_main:
                log.warning("stopped at step %d by %s; nothing saved (checkpoint.every=0)", self.step,
                            signals.requested or "a signal to another rank")
            return True
        if not saved:
            self.save()
        if self.background is not None:  # saved means written: the background write ends first
            self.background.wait()
        if self.env.is_main:
            log.warning("stopped at step %d by %s; checkpoint saved, the same command resumes",
                        self.step, signals.requested or "a signal to another rank")
        return True

    def _log_train(self, window: TrainWindow, lr: float, grad_norm: torch.Tensor) -> dict:
        """One train line: the window's mean of each loss term, its throughput and MFU; returns the row logged."""
        terms, tokens, seconds = window.read(self.env)
        tok_s = tokens / seconds
        flops_s = self.flops_per_token * tok_s / self.env.world_size
        # a head's loss is a cross-entropy over classes or an MSE: no perplexity
        ppl = {} if self.cfg.task.file or "loss" not in terms else {"train/ppl": perplexity(terms["loss"])}
        row = {
            **{f"train/{name}": value for name, value in terms.items()}, **ppl, "train/lr": lr,
            "train/grad_norm": grad_norm.item(), "train/skipped_steps": self.skipped.total,
            "perf/tokens_per_s": tok_s, "perf/tflops_per_device": flops_s / 1e12,
            "perf/mfu": flops_s / self.peak_flops if self.peak_flops else None,
        }
        if self.data.is_mixture:  # tokens each source has served, and the epochs they make of its windows
            draws = self.loader.draws_per_source()
            for source, n, windows in zip(self.data.sources, draws.tolist(), self.loader.sources):
                row |= {f"data/{source.name}/tokens": n * self.cfg.data.seq_len,
                        f"data/{source.name}/epochs": n / windows.num_samples}
        perf = f"mfu {row['perf/mfu']:.1%}" if self.peak_flops else f"{flops_s / 1e12:.3f} TFLOP/s"
        skipped = f" | {self.skipped.total} skipped" if self.skipped.total else ""
        # "loss" first, then the family's others; none when every step of the window was skipped
        shown = [f"{name} {value:.4f}" for name, value in terms.items()] or ["loss n/a"]
        if ppl:
            shown.insert(1, f"ppl {ppl['train/ppl']:.1f}")
        self.metrics.log(self.step, self.tokens_seen, self.elapsed_s(), row, (
            f"step {{step}}/{self.cfg.train.steps} | {' | '.join(shown)} | "
            f"lr {{train_lr:.2e}} | grad norm {{train_grad_norm:.3f}} | {{perf_tokens_per_s:,.0f}} tok/s | "
            f"{perf}{skipped}"
        ))
        return {"step": self.step, **row}

    def elapsed_s(self) -> float:
        """Wall seconds this run has trained, over every process that resumed it (evaluations included)."""
        return self.elapsed_before + (time.perf_counter() - self.fit_started if self.fit_started else 0.0)

    def _evaluate_tasks(self, history: list[dict]) -> None:
        """Score train.eval_tasks: logged like validation, and the latest results kept in <out_dir>/tasks.json."""
        scores = self.tasks(self.engine, self.env)
        self.metrics.log(self.step, self.tokens_seen, self.elapsed_s(), scores, tasks_line(scores))
        history.append({"step": self.step, **scores})
        if self.env.is_main:
            atomic_write_text(self.out_dir / TASKS_FILE, json.dumps({"step": self.step, **scores}, indent=2) + "\n")

    def log_sample(self) -> None:
        """Continue log.sample_prompt with the current weights; rank 0 logs the text (every rank samples)."""
        text = periodic_sample(self.engine, self.family, self.cfg, self.tokenizer, self.env)
        self.metrics.log_text("sample", self.step, text)
        if self.env.is_main:
            log.info("step %d | sample: %r", self.step, text)

    def _stop_agreed(self, signals: StopSignals) -> bool:
        """Whether any rank received a stop signal (a collective: every rank must call it at the same step)."""
        return self.env.any_rank(signals.requested is not None)

    def _check_nonfinite(self) -> None:
        """Read the skipped-step counters (one host sync) and stop after too many non-finite steps in a row."""
        new, longest = self.skipped.read()

        def advice() -> str:
            return (f"the last good checkpoint is {last_good(self.ckpt_root)}. Lower optim.lr or raise "
                    "optim.grad_clip, then resume from it")

        if not self.engine.skips_nonfinite:
            # DeepSpeed applies its step before the norm is known: the weights may no longer be finite, so stop
            if longest:
                raise TrainingError(f"step {self.step}: a step with a non-finite loss or gradient norm, which "
                                    f"{self.cfg.parallel.engine} applied (it cannot skip one, so "
                                    f"train.max_nonfinite_steps does not apply); {advice()}")
            return
        if new:
            log.warning("step %d: %d optimizer steps skipped since the last check for a NaN/inf loss or gradient "
                        "norm (%d in all)", self.step, new, self.skipped.total)
        if longest >= self.cfg.train.max_nonfinite_steps:
            raise TrainingError(
                f"step {self.step}: {longest} steps in a row with a non-finite loss or gradient "
                f"norm (train.max_nonfinite_steps={self.cfg.train.max_nonfinite_steps}); {advice()}"
            )

    def _train_step(self, lr: float) -> Step:
        """One optimizer step over this rank's next micro-batches (the objective's batches: (x, y) for a next-token
        model, ...), which the family's loss reads."""
        micro_batches = [to_device(batch, self.env.device) for batch in self.loader.next_batch()]
        # the family's update averages over the whole world: a rank counts its own tokens, or (tensor parallelism,
        # which runs a mixture of experts whole) the same as the rest of its group, so every sign is the data-parallel
        # sum's; pipeline stages, whose routers differ, are refused for mixtures before launch
        return train_step(self.engine, self.loss, micro_batches, lr, self.cfg.optim.grad_clip,
                          self.family.training.after_step, self.env.all_reduce_mean, lr / self.cfg.optim.lr)

    def save(self) -> Path:
        """Checkpoint the run (a collective; see `save_run`)."""
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed_s(),
                 **self.skipped.state_dict(), **self.loader.state_dict(), "data": self.data.identity()}
        start = time.perf_counter()
        path = save_run(self.engine, self.ckpt_root, state, self.cfg, self.env, self.background)
        self.save_seconds.append(time.perf_counter() - start)
        return path

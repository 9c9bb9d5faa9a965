"""The engines: one interface over DDP, FSDP2 and DeepSpeed ZeRO for the trainer and the checkpoints.

An engine owns the model (built for its engine), the optimizer and how a micro-batch's gradients are
accumulated, reduced, clipped and applied. The model code is the same under every engine.
"""

import contextlib
import logging
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from lm.checkpoint import DEEPSPEED_TAG, UNIVERSAL_TAG
from lm.config import ConfigError, JobConfig
from lm.consolidate import load_consolidated_weights
from lm.distributed.activation import checkpoint_blocks, compile_blocks
from lm.distributed.ddp import grad_sync, wrap_ddp
from lm.distributed.env import DistEnv, ensure_process_group
from lm.models.factory import build_model

log = logging.getLogger(__name__)


def build_optimizer(model: nn.Module, cfg: JobConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on weight matrices only: biases, norms and embeddings are not decayed."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue  # the tied output head shares the embedding's Parameter
            seen.add(id(param))
            skip = isinstance(module, (nn.Embedding, nn.LayerNorm, nn.RMSNorm)) or name == "bias"
            (no_decay if skip else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups,
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        eps=cfg.optim.eps,
        # one kernel over all parameters instead of a dozen passes: 3.4x faster on CPU (5.8 vs 19.6 ms per
        # step for demo's 7M parameters, python -m lm.bench's machine), the standard choice on CUDA; and
        # only the fused step can skip on the device (found_inf), which optimizer_step relies on
        fused=True,
    )


def autocast_for(cfg: JobConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA by default; plain fp32 on CPU, where bf16 autocast is slower."""
    dtype = cfg.train.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def check_lstm_autocast(cfg: JobConfig, device: torch.device) -> None:
    """Refuse bf16 autocast of an LSTM on a CPU whose oneDNN cannot run it, before the first step would.

    CPU autocast hands nn.LSTM to oneDNN in bf16, which CPUs without bf16 support reject with an opaque
    "could not create a primitive descriptor"; a one-unit LSTM tells which kind of CPU this is.
    """
    if cfg.model.arch != "lstm" or device.type != "cpu" or cfg.train.dtype != "bfloat16":  # auto is fp32 on CPU
        return
    with torch.device("meta"):  # uninitialised weights: the probe draws nothing from the RNG the run seeded
        probe = nn.LSTM(1, 1)
    probe.to_empty(device="cpu")
    try:
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            probe(torch.zeros(1, 1, 1))
    except RuntimeError:
        raise ConfigError("train.dtype: bfloat16 autocasts model.arch=lstm to bf16, which this CPU's LSTM kernel "
                          "(oneDNN) cannot run; use train.dtype=float32 (or auto) on the CPU") from None


class TorchEngine:
    """ddp (replicated model, DistributedDataParallel) or fsdp (FSDP2 fully_shard); DCP checkpoints."""

    def __init__(self, cfg: JobConfig, env: DistEnv, init_from: Path | None = None) -> None:
        self.cfg, self.env, self.name = cfg, env, cfg.parallel.engine
        if self.name == "fsdp":
            from lm.distributed.fsdp import build_fsdp_model, load_full_weights

            self.model = build_fsdp_model(cfg, env)
            if init_from is not None:
                load_full_weights(self.model, init_from)
            self.train_model = self.model  # fully_shard works in place; precision is its policy's
            self.autocast = contextlib.nullcontext()
        else:
            check_lstm_autocast(cfg, env.device)
            self.model = build_model(cfg.model)
            if init_from is not None:
                load_consolidated_weights(init_from, self.model)
            self.model.to(env.device)
            checkpoint_blocks(self.model, cfg.parallel.activation_checkpointing)
            if cfg.train.compile:
                compile_blocks(self.model)
            self.train_model = wrap_ddp(self.model, env)
            self.autocast = autocast_for(cfg, env.device)
        self.optimizer = build_optimizer(self.model, cfg)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def forward_backward(self, batch: list[torch.Tensor], last: bool, num_micro: int,
                         poison: bool = False) -> torch.Tensor:
        """One micro-batch: forward, backward of loss / num_micro; gradients are reduced on the last.
        `poison` makes the loss NaN (the fault-injection hook of the non-finite guard's tests)."""
        if self.name == "fsdp":
            self.model.set_requires_gradient_sync(last)
            sync = contextlib.nullcontext()
        else:
            sync = grad_sync(self.train_model, sync=last)
        with sync, self.autocast:
            _, loss = self.train_model(*batch)
            if poison:
                loss = loss * float("nan")
            (loss / num_micro).backward()
        return loss.detach()

    def optimizer_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip the global gradient norm and step, unless the norm is NaN or inf: then the step is
        skipped. Clears gradients; returns the norm before clipping and whether the step was applied, as
        0-dim tensors on the device (no host sync).

        A NaN anywhere in any rank's loss or gradients reaches every rank's norm through the gradient
        reduction, so all ranks skip together.
        """
        clip = self.cfg.optim.grad_clip or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if isinstance(norm, DTensor):  # sharded gradients: the norm is itself sharded until reduced
            norm = norm.full_tensor()
        applied = torch.isfinite(norm)
        # The skip is decided on the device: the fused AdamW leaves weights, moments and step counts
        # alone where found_inf is 1, so the host never waits for the norm before queuing the next step.
        self.optimizer.found_inf = (~applied).float()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, applied

    def parameters_finite(self) -> bool:
        """Whether this rank's (shard of the) weights holds only finite values."""
        return all(bool(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all())
                   for p in self.model.parameters())

    def eval_loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        with self.autocast:
            return self.model(*batch)[1]

    def train(self, mode: bool) -> None:
        self.model.train(mode)

    @contextlib.contextmanager
    def full_weights(self):
        """Every parameter whole on every rank inside the block, so any method of the model runs (sampling
        calls an encoder-decoder's encode and decode, which FSDP's forward hooks never see)."""
        if self.name != "fsdp":
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        sharded = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for module in sharded:
            module.unshard()
        try:
            yield
        finally:
            for module in sharded:
                module.reshard()

    def save(self, directory: Path) -> None:
        """Collectively write model and optimizer as DCP shards into `directory`."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)

    def load(self, directory: Path, state: dict) -> None:
        """Load model and optimizer, resharded to this world size and engine (DCP is the same for both)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


class DeepSpeedEngine:
    """DeepSpeed ZeRO stage 1-3 around our model and our AdamW; DeepSpeed's own checkpoints."""

    name = "deepspeed"

    def __init__(self, cfg: JobConfig, env: DistEnv, load_universal: bool = False,
                 init_from: Path | None = None) -> None:
        from lm.distributed.zero import initialize

        self.cfg, self.env = cfg, env
        if cfg.train.compile:  # not wired up (nor tried) inside DeepSpeed's engine
            log.warning("train.compile is not applied under parallel.engine=deepspeed; the model runs eager")
        self.model = build_model(cfg.model)
        if init_from is not None:
            load_consolidated_weights(init_from, self.model)
        self.model.to(env.device)
        checkpoint_blocks(self.model, cfg.parallel.activation_checkpointing)
        optimizer = build_optimizer(self.model, cfg)
        self.engine, self.optimizer = initialize(self.model, optimizer, cfg, env, load_universal)
        self.load_universal = load_universal

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def forward_backward(self, batch: list[torch.Tensor], last: bool, num_micro: int,
                         poison: bool = False) -> torch.Tensor:
        """DeepSpeed divides the loss by its accumulation steps and steps the optimizer on the last one."""
        _, loss = self.engine(*batch)
        if poison:
            loss = loss * float("nan")
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def optimizer_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step already happened inside DeepSpeed's last micro-step, which (without fp16 loss
        scaling) cannot skip it; report its gradient norm and whether it was finite, as 0-dim tensors on
        the device like the other engines' (DeepSpeed hands the norm over as a Python float)."""
        norm = self.engine.get_global_grad_norm()
        norm = torch.as_tensor(0.0 if norm is None else norm, dtype=torch.float32, device=self.env.device)
        return norm, torch.isfinite(norm)

    def parameters_finite(self) -> bool:
        """Whether this rank's partition of the fp32 master weights holds only finite values."""
        return all(bool(torch.isfinite(p).all()) for group in self.optimizer.param_groups for p in group["params"])

    def eval_loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        return self.engine(*batch)[1]

    def train(self, mode: bool) -> None:
        self.engine.train(mode)

    def full_weights(self) -> contextlib.AbstractContextManager:
        """Every parameter whole on every rank inside the block (ZeRO-3 gathers them; stages 1-2 hold them)."""
        if self.cfg.parallel.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.model.parameters()))

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag=DEEPSPEED_TAG)

    def load(self, directory: Path, state: dict) -> None:
        tag = UNIVERSAL_TAG if self.load_universal else DEEPSPEED_TAG
        path, _ = self.engine.load_checkpoint(str(directory), tag=tag, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"{directory / tag}: DeepSpeed found no checkpoint to load")


def build_engine(cfg: JobConfig, env: DistEnv, load_universal: bool = False,
                 init_from: Path | None = None) -> TorchEngine | DeepSpeedEngine:
    """The engine parallel.engine names; the global RNG must be seeded before (it draws the weights).

    init_from: a consolidated safetensors file whose weights replace the drawn ones (a new run).
    """
    if cfg.parallel.engine != "ddp":
        ensure_process_group(env)
    if cfg.parallel.engine == "deepspeed":
        return DeepSpeedEngine(cfg, env, load_universal, init_from)
    return TorchEngine(cfg, env, init_from)

"""The optimizer every engine steps: AdamW, with weight decay on weight matrices only; or, with optim.name
muon, Muon for the hidden matrices and that same AdamW for the rest."""

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn

from lm.config import OptimConfig
from lm.distributed.muon import Muon


def build_optimizer(model: nn.Module, cfg: OptimConfig, heads: Sequence[nn.Module] = (), world_size: int = 1,
                    rank: int = 0) -> torch.optim.AdamW:
    """AdamW with weight decay on weight matrices only: biases, norms and embeddings are not decayed.

    Under muon the weights of the Linear layers inside the model (every hidden matrix) form a third group
    stepped by Muon, with weight decay; the output layers `heads` (`Family.output_layers`) stay with AdamW,
    like the embeddings: their rows score one token each, they are not a map between hidden spaces whose
    directions Muon evens out. `world_size` and `rank` (of the default process group) let Muon's ranks share
    its work under ddp.
    """
    decay, no_decay, matrices = [], [], []
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue  # the tied output head shares the embedding's Parameter
            seen.add(id(param))
            if cfg.name == "muon" and isinstance(module, nn.Linear) and module not in heads and name == "weight":
                matrices.append(param)
                continue
            # nn.LSTM names its biases bias_ih_l0, bias_hh_l0, ...
            skip = isinstance(module, (nn.Embedding, nn.LayerNorm, nn.RMSNorm)) or name.partition("_")[0] == "bias"
            (no_decay if skip else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # one kernel over all parameters instead of a dozen passes: 3.4x faster on CPU (5.8 vs 19.6 ms per
    # step for demo's 7M parameters, python -m lm.bench's machine), the standard choice on CUDA; and
    # only the fused step can skip on the device (found_inf), which optimizer_step relies on
    adamw = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "fused": True}
    if cfg.name == "muon":
        groups.append({"params": matrices, "weight_decay": cfg.weight_decay, "muon": True})
    # a group without parameters has no name in a DCP checkpoint, so its settings could not be restored (a
    # tied GPT under muon decays nothing with AdamW)
    groups = [group for group in groups if group["params"]]
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, **adamw)
    return Muon(groups, momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps, world_size=world_size, rank=rank,
                **adamw)


def set_lr(optimizer: torch.optim.Optimizer, lr: float, cfg: OptimConfig) -> None:
    """Set the schedule's learning rate `lr` (a fraction of optim.lr): the same fraction of optim.muon_lr
    for Muon's matrices. Read from the config, not the groups, which a resumed checkpoint overwrites."""
    for group in optimizer.param_groups:
        group["lr"] = lr * cfg.muon_lr / cfg.lr if group.get("muon") else lr


@contextlib.contextmanager
def settings_kept(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Load a checkpoint's optimizer state inside the block, keeping each group's settings (weight decay, betas,
    eps, Muon's momentum) as this run's config made them: loading puts the checkpoint's into the groups, so a
    resumed run that changed optim.weight_decay would go on with the old value while saying it changed, and a
    parameter that moved to another group since (nn.LSTM's biases, no longer decayed) would mix two groups'."""
    kept = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    yield
    for group, own in zip(optimizer.param_groups, kept, strict=True):
        group.update(own)

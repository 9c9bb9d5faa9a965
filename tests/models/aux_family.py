"""A model family from outside lm that adds loss terms: the GPT with three more named terms, in this file alone.
Importing this module registers it as model.arch=gpt_aux; the tools find it through
LM_FAMILIES=tests.models.aux_family. Nothing in lm/ names it or its terms.

- "hidden_sq", a token-weighted mean: the mean square of the final hidden states, weighted by model.aux_weight
  into the objective when that is not 0 (so it changes the gradients);
- "targets", a sum: the tokens predicted, over the step's micro-batches and the data-parallel ranks;
- "hidden_max", a max: the largest final hidden value.
"""

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn as nn

from lm.models.family import PLAIN_LOSS, LossOptions, Run
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.family import FAMILY as GPT
from lm.models.registry import register
from lm.models.terms import Losses, Reduce, Term


@dataclass
class AuxConfig(GPTConfig):
    arch: str = "gpt_aux"
    title: ClassVar[str] = "a GPT with auxiliary loss terms"
    aux_weight: float = 0.0
    """How much "hidden_sq" counts in the objective (0: logged only)"""


def loss(model: nn.Module, run: Run, batch: list[torch.Tensor], optim: LossOptions = PLAIN_LOSS) -> Losses:
    """The GPT's terms, and the three above."""
    outputs = []

    def run_and_keep(*inputs: torch.Tensor) -> torch.Tensor:
        outputs.append(run(*inputs))
        return outputs[-1]

    losses = GPT.training.loss(model, run_and_keep, batch, optim)
    h = outputs[0].float()  # (B, T, C)
    n = batch[1].numel()
    terms = {**losses.terms,
             "hidden_sq": Term(h.square().mean(), Reduce.MEAN, n),
             "targets": Term(torch.tensor(float(n), device=h.device), Reduce.SUM),
             "hidden_max": Term(h.detach().max(), Reduce.MAX)}
    if not model.cfg.aux_weight:
        return Losses(terms, losses.objective)
    terms["objective"] = Term(losses.optimized + model.cfg.aux_weight * terms["hidden_sq"].value, Reduce.MEAN, n)
    return Losses(terms, "objective")


register(replace(GPT, name="gpt_aux", config_class=AuxConfig, training=replace(GPT.training, loss=loss)))

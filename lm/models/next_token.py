"""What the next-token families (the GPT, the LSTM, a decoder a user adds) share: they read windows of tokens and
predict each next one. Their spec takes `TRAINING` and `SAMPLER` from here; their model's forward is
`(idx, positions=None, cache=None) -> hidden states`, with `logits(h)` and `new_cache(...)`
(`lm.models.generate.DecoderLM`).

Their batches are NextToken's (`lm.data.objectives`): (x, y), or (x, y, positions) with data.document_mask.
The model's forward maps x (and positions) to hidden states (B, T, C) and `model.logits` those to logits; the
loss is their cross-entropy against y, whole or `loss_chunk` positions at a time, with the z-loss term when
asked (`lm.models.loss`). They sample by continuing a prompt (`lm.models.generate`), and lm.eval scores them
over strided windows of any text.
"""

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from lm.data.objectives import NextToken, Objective
from lm.models.config import ModelConfig
from lm.models.family import PLAIN_LOSS, LossOptions, Run, SampleOptions, Sampler, Scored, Training
from lm.models.generate import fit_prompt, generate, generate_batch
from lm.models.loss import cross_entropy_terms, next_token_loss
from lm.models.terms import Losses
from lm.tokenizer import continuation_text, prompt_ids

if TYPE_CHECKING:
    from lm.data.config import DataConfig


def objective(cfg: ModelConfig, data: "DataConfig", seq_len: int, seed: int,
              document_eot: int | None = None) -> Objective:
    return NextToken(document_eot)


def _cross_entropy(model: nn.Module, run: Run, batch: list[torch.Tensor], with_z: bool) -> torch.Tensor:
    """Mean cross-entropy of the batch's next tokens (with_z: (2,), and the mean log Z^2)."""
    x, y, *positions = batch
    h = run(x, *positions)  # (B, T, C)
    # model.loss_chunk where the family has it: the head and loss a chunk of positions at a time
    return next_token_loss(model.logits, h, y, getattr(model.cfg, "loss_chunk", 0), with_z)


def loss(model: nn.Module, run: Run, batch: list[torch.Tensor], optim: LossOptions = PLAIN_LOSS) -> Losses:
    """The cross-entropy over the batch's next tokens (and optim.z_loss's term), weighted by their count."""
    ce = _cross_entropy(model, run, batch, bool(optim.z_loss))
    return cross_entropy_terms(ce, batch[1].numel(), optim.z_loss)


def score(model: nn.Module, run: Run, batch: list[torch.Tensor]) -> Scored:
    return Scored(_cross_entropy(model, run, batch, False).float(), batch[1].numel())


def sample(model: nn.Module, tokenizer, prompt: str, options: SampleOptions) -> str:
    """The prompt (led by the tokenizer's BOS, or end-of-text) continued by up to options.max_new_tokens tokens,
    its start dropped if prompt and new tokens would not fit the context."""
    n = options.max_new_tokens
    ids = fit_prompt(prompt_ids(tokenizer, prompt), n, model.cfg.block_size)
    # an imported model may hold more rows than its tokenizer has ids (Qwen's padded vocabulary): those decode to
    # nothing, so they are never drawn
    vocab = min(model.cfg.vocab_size, tokenizer.n_vocab)
    if options.stop_at_end:
        new = generate(model, ids, n, temperature=options.temperature, top_k=options.top_k, top_p=options.top_p,
                       eot_id=tokenizer.eot_token, seed=options.seed, compiled=options.compiled, vocab_size=vocab)
    else:
        device = options.device or next(model.parameters()).device
        generator = torch.Generator(device).manual_seed(options.seed)
        idx = torch.tensor([ids], device=device)  # (1, T)
        new = generate_batch(model, idx, n, temperature=options.temperature, top_k=options.top_k,
                             top_p=options.top_p, generator=generator, compiled=options.compiled,
                             vocab_size=vocab)[0].tolist()
        if tokenizer.eot_token in new:  # a fixed-length batch runs past the end of the text; show up to it
            new = new[:new.index(tokenizer.eot_token)]
    return prompt + continuation_text(tokenizer, ids, new)


TRAINING = Training(objective, loss, score, causal_lm=True)
"""A next-token family's objective, loss and scores."""
SAMPLER = Sampler(sample)
"""A next-token family's sampling: continuing a prompt."""

"""Scoring downstream tasks (`lm.data.tasks`) with a next-token model: the log-likelihood of each choice's
continuation after its context, batched and padded.

The continuation's ids are those of context + continuation after the context's own (the context's trailing spaces
moved to the continuation first), as lm-evaluation-harness encodes a pair; the context starts as a document did
in training (`lm.tokenizer.prompt_ids`: the tokenizer's BOS when it has one). A pair
longer than the model's positions keeps its last block_size + 1 tokens. Only the continuation's positions go
through the head, so a batch never holds (B, T, vocabulary) logits.

Ranks split the items (item i on data-parallel rank i mod n) and every rank runs the same number of forward
passes, padding with a one-token filler: a sharded model gathers its weights in each forward, so a rank with
fewer items must still take part. The caller adds the ranks' `TaskScore`s.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lm.data.tasks import Item, TaskScore
from lm.errors import DataError
from lm.tokenizer import Tokenizer, prompt_ids

__all__ = ["LogitsAt", "Pair", "encode_items", "loglikelihoods", "model_logits_at", "score_items"]

Pair = tuple[list[int], list[int]]
"""(context ids, continuation ids)"""
LogitsAt = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(x (B, T) ids, flat (N,) indices into the B*T positions) -> logits (N, vocabulary) at those positions"""


def encode_items(tokenizer: Tokenizer, items: list[Item]) -> list[list[Pair]]:
    """Each item's (context ids, continuation ids) per choice."""
    cache: dict[str, tuple[list[int], list[int]]] = {}  # the choices of an item mostly share their context

    def pair(context: str, continuation: str) -> Pair:
        # the context's trailing spaces start the continuation, whose ids are the whole text's after the context's
        # own: a SentencePiece tokenizer encodes " yes" alone as a lone "▁" and "▁yes", in a text as "▁yes"
        kept = context.rstrip()
        context, continuation = kept, context[len(kept):] + continuation
        if context not in cache:
            cache[context] = (prompt_ids(tokenizer, context), tokenizer.encode_ordinary(context))
        prompt, alone = cache[context]
        return prompt, tokenizer.encode_ordinary(context + continuation)[len(alone):]

    return [[pair(c, t) for c, t in zip(item.contexts, item.continuations)] for item in items]


def _window(pair: Pair, block_size: int) -> tuple[list[int], int]:
    """The ids a pair feeds the model (context + continuation but the last, at most block_size of them) and how
    many continuation ids it scores (the last ones of the window)."""
    context, continuation = pair
    if not continuation:
        raise DataError("a choice's continuation encodes to no tokens; nothing to score")
    ids = (context + continuation)[-(block_size + 1):]
    return ids, min(len(continuation), len(ids) - 1)


@torch.no_grad()
def loglikelihoods(logits_at: LogitsAt, pairs: list[Pair], block_size: int, vocab_size: int, batch_size: int,
                   device: torch.device, batches: int | None = None) -> list[float]:
    """The summed log-probability of each pair's continuation given its context, in the pairs' order.

    `batches`: run exactly this many forwards (at least what the pairs need), the rest on a filler, so that every
    rank of a sharded model runs as many as the others. `vocab_size`: the tokenizer's ids; a padded head's
    extra logits are left out of the softmax."""
    need = -(-len(pairs) // batch_size)
    batches = need if batches is None else batches
    assert batches >= need, (batches, need)
    windows = [_window(p, block_size) for p in pairs]
    order = sorted(range(len(pairs)), key=lambda i: -len(windows[i][0]))  # long ones together: less padding
    out = [0.0] * len(pairs)
    for b in range(batches):
        chunk = order[b * batch_size:(b + 1) * batch_size]
        if not chunk:  # a filler: one token, scored and dropped
            logits_at(torch.zeros(1, 1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long,
                                                                                      device=device))
            continue
        width = max(len(windows[i][0]) for i in chunk) - 1
        x = torch.zeros(len(chunk), width, dtype=torch.long)  # (B, T) right-padded: causal, so padding is unseen
        index, targets, owner = [], [], []
        for row, i in enumerate(chunk):
            ids, scored = windows[i]
            x[row, :len(ids) - 1] = torch.tensor(ids[:-1])
            first = len(ids) - 1 - scored  # the position whose logits predict the first scored id
            index += range(row * width + first, row * width + len(ids) - 1)
            targets += ids[len(ids) - scored:]
            owner += [row] * scored
        logits = logits_at(x.to(device), torch.tensor(index, device=device))[:, :vocab_size].float()  # (N, V)
        logp = -F.cross_entropy(logits, torch.tensor(targets, device=device), reduction="none")  # (N,)
        sums = torch.zeros(len(chunk), dtype=torch.float64, device=device).index_add_(
            0, torch.tensor(owner, device=device), logp.double())
        for row, i in enumerate(chunk):
            out[i] = float(sums[row])
    return out


def score_items(logits_at: LogitsAt, pairs: list[list[Pair]], items: list[Item], block_size: int, vocab_size: int,
                batch_size: int, device: torch.device, rank: int = 0, ranks: int = 1) -> TaskScore:
    """This rank's share of one task's items (item i on rank i mod `ranks`) scored into a `TaskScore`; every rank
    runs as many forwards as the rank with the most choices to score."""
    mine = range(rank, len(items), ranks)
    flat = [p for i in mine for p in pairs[i]]
    per_rank = [sum(len(pairs[i]) for i in range(r, len(items), ranks)) for r in range(ranks)]
    lls = loglikelihoods(logits_at, flat, block_size, vocab_size, batch_size, device,
                         batches=max(-(-n // batch_size) for n in per_rank))
    score, at = TaskScore(), 0
    for i in mine:
        n = len(pairs[i])
        score.add(items[i], lls[at:at + n])
        at += n
    return score


def model_logits_at(model: torch.nn.Module, run: Callable[[torch.Tensor], torch.Tensor]) -> LogitsAt:
    """`LogitsAt` for a next-token model: its forward `run` (the model, or an engine's wrapper of it) to hidden
    states (B, T, C), the head on the chosen positions only."""
    return lambda x, index: model.logits(run(x).flatten(0, 1)[index])

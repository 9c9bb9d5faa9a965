"""Scoring a model on token streams: loss (nats per token) of a next-token model over strided windows, of any
other model on its own pretraining task, and the unigram baseline.

A next-token model (`Training.causal_lm`: the GPT, the LSTM) scores long inputs with strided windows: every
token is scored exactly once, and every window after the first keeps at least `seq_len - stride` tokens of
context before the tokens it scores; an LSTM starts each window from a zero state, as it started each training
window. Any other family is scored on its pretraining task, window by window (`score_windows`): each window of
seq_len + 1 tokens goes through the objective exactly as the trainer's validation does (window k with the key
k: an encoder-decoder's span corruption, an encoder's masking), and the loss is the family's over its targets.
"""

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from lm.data.objectives import Objective, document_positions
from lm.data.shards import check_manifest, check_token_ids, open_shard, read_manifest
from lm.errors import DataError
from lm.io import read_utf8
from lm.models.family import Family
from lm.tokenizer import document_prefix

__all__ = ["eval_windows", "first_tokens", "score_stream", "score_windows", "text_tokens", "unigram_entropy",
           "val_streams"]


def eval_windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """Windows over a stream of `n_tokens` tokens, as (start, end, first_scored) triples.

    The window's inputs are tokens[start:end] and its targets tokens[start+1:end+1]; only targets at
    stream index >= first_scored are scored. Targets 1..n_tokens-1 are each scored exactly once.
    """
    if not 0 < stride <= seq_len:
        raise ValueError(f"--stride: must be in [1, seq_len={seq_len}], got {stride}")
    windows = []
    scored = 0  # stream index of the last target scored so far
    while scored < n_tokens - 1:
        end = min(scored + (stride if scored else seq_len), n_tokens - 1)
        windows.append((max(0, end - seq_len), end, scored + 1))
        scored = end
    return windows


@torch.no_grad()
def score_stream(model: torch.nn.Module, tokens: np.ndarray, seq_len: int, stride: int,
                 batch_size: int, device: torch.device, progress: tqdm | None = None,
                 document_eot: int | None = None) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) and number of targets scored over one token stream.
    With `document_eot` (a model trained with data.document_mask) each window attends within its documents,
    as in training (`lm.data.objectives.document_positions`)."""
    windows = eval_windows(len(tokens), seq_len, stride)
    nll, count = 0.0, 0
    # Windows of equal length share a batch; only the first and last can be shorter than seq_len.
    by_len: dict[int, list[tuple[int, int, int]]] = {}
    for w in windows:
        by_len.setdefault(w[1] - w[0], []).append(w)
    for length, group in by_len.items():
        for i in range(0, len(group), batch_size):
            chunk = group[i:i + batch_size]
            rows = np.stack([tokens[s:e + 1] for s, e, _ in chunk]).astype(np.int64)
            x = torch.from_numpy(rows[:, :-1]).to(device)  # (B, T)
            y = torch.from_numpy(rows[:, 1:]).to(device)  # (B, T)
            positions = None
            if document_eot is not None:
                positions = torch.from_numpy(document_positions(rows[:, :-1], document_eot)).to(device)  # (B, T)
            logits = model.logits(model(x, positions))  # (B, T, padded_vocab_size)
            losses = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
            losses = losses.view(len(chunk), length)
            # target j of a window sits at stream index start + 1 + j
            first = torch.tensor([f - s - 1 for s, _, f in chunk], device=device)
            mask = torch.arange(length, device=device)[None, :] >= first[:, None]
            nll += losses[mask].double().sum().item()
            count += int(mask.sum())
            if progress is not None:
                progress.update(int(mask.sum()))
    return nll, count


@torch.no_grad()
def stream_windows(streams: list[np.ndarray], seq_len: int) -> list[np.ndarray]:
    """Every whole window of seq_len + 1 tokens the loader would cut from the streams (window j of a stream
    starts at token j * seq_len), numbered across streams in order: window k is the val split's sample k."""
    return [np.asarray(s[j * seq_len:(j + 1) * seq_len + 1]) for s in streams for j in range((len(s) - 1) // seq_len)]


@torch.no_grad()
def score_windows(family: Family, model: torch.nn.Module, streams: list[np.ndarray], objective: Objective,
                  seq_len: int, batch_size: int, device: torch.device,
                  progress: tqdm | None = None) -> tuple[float, int, int | None]:
    """Summed NLL (nats) of the targets the family scores, their count, and how many it predicts right (None
    where the family reports no accuracy), over every window of seq_len + 1 tokens of the streams (window k put
    through the objective with the key k, as validation does)."""
    rows = stream_windows(streams, seq_len)
    nll, count, correct = 0.0, 0, None
    for i in range(0, len(rows), batch_size):
        keys = np.arange(i, min(i + batch_size, len(rows)), dtype=np.int64)
        batch = [torch.from_numpy(t).to(device) for t in objective(np.stack(rows[i:i + batch_size]), keys)]
        scored = family.training.score(model, model, batch)
        nll += scored.loss.double().item() * scored.count
        count += scored.count
        if scored.correct is not None:
            correct = (correct or 0) + int(scored.correct)
        if progress is not None:
            progress.update(len(keys) * seq_len)
    return nll, count, correct


def unigram_entropy(streams: list[np.ndarray]) -> float:
    """Entropy (nats/token) of the streams' own token frequencies: the loss of the best model that
    ignores context, a baseline a trained model must beat by a wide margin."""
    counts = np.bincount(np.concatenate([np.asarray(s[1:]) for s in streams]).astype(np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def text_tokens(path: Path, tokenizer) -> tuple[np.ndarray, int]:
    """Tokens of a UTF-8 text file led by the tokenizer's BOS, or without one an end-of-text token (the end of
    a previous document), as a document starts in training, so its first token is scored too; and the file's
    size in bytes."""
    text = read_utf8(path)
    if not text:
        raise DataError(f"{path}: the file is empty; expected UTF-8 text")
    ids = (document_prefix(tokenizer) or [tokenizer.eot_token]) + tokenizer.encode_ordinary(text)
    return np.asarray(ids, dtype=np.int64), len(text.encode("utf-8"))


def val_streams(data_dir: str | Path, tokenizer: str, vocab_size: int) -> list[np.ndarray]:
    """The val split of prepared data, one memory-mapped token stream per shard. The data must have been
    prepared with the model's `tokenizer` (as training checks it: shards of another tokenizer are refused as
    such, not as damaged files), and each shard must hold only ids below `vocab_size` (scoring reads every
    token anyway, so one pass more costs little)."""
    manifest = read_manifest(data_dir)
    check_manifest(manifest, tokenizer, vocab_size, data_dir)
    files = [Path(data_dir) / s["file"] for s in manifest["splits"]["val"]["shards"]]
    if not files:
        raise DataError(f"{data_dir}: the val split has no shards; prepare with data.val_fraction > 0")
    streams = [open_shard(path) for path in files]
    for path, stream in zip(files, streams):
        if stream.max() >= vocab_size:
            check_token_ids(stream, vocab_size, path)
    return streams


def first_tokens(streams: list[np.ndarray], max_tokens: int) -> list[np.ndarray]:
    """The streams cut to their first `max_tokens` tokens in all (a stream left under 2 tokens, which
    holds nothing to score, is dropped)."""
    kept, left = [], max_tokens
    for stream in streams:
        if left < 2:
            break
        kept.append(stream[:left])
        left -= len(kept[-1])
    return kept

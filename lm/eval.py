"""`python -m lm.eval`: loss, perplexity and bits per byte of a checkpoint on val shards or a text file.

The architecture comes from the checkpoint. A decoder-only model (GPT or LSTM) scores long inputs with
strided windows: every token is scored exactly once, and every window after the first keeps at least
`seq_len - stride` tokens of context before the tokens it scores; an LSTM starts each window from a
zero state, as it started each training window. An encoder-decoder is scored on its pretraining task:
each window of seq_len + 1 tokens is span-corrupted exactly as the trainer's validation does (window k's
noise drawn from (train.seed, k)), and the loss is over the target tokens (sentinels and masked spans).
"""

import argparse
import logging
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from lm.checkpoint import load_for_inference
from lm.cli import run
from lm.runtime import tune_cpu
from lm.data.objectives import SpanCorruption
from lm.data.shards import DataError, open_shard, read_manifest
from lm.tokenizer import load_tokenizer

log = logging.getLogger("lm.eval")


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
                 batch_size: int, device: torch.device, progress: tqdm | None = None) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) and number of targets scored over one token stream."""
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
            logits, _ = model(x)
            losses = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view(len(chunk), length)
            # target j of a window sits at stream index start + 1 + j
            first = torch.tensor([f - s - 1 for s, _, f in chunk], device=device)
            mask = torch.arange(length, device=device)[None, :] >= first[:, None]
            nll += losses[mask].double().sum().item()
            count += int(mask.sum())
            if progress is not None:
                progress.update(int(mask.sum()))
    return nll, count


@torch.no_grad()
def score_span_corruption(model: torch.nn.Module, streams: list[np.ndarray], objective: SpanCorruption,
                          batch_size: int, device: torch.device, progress: tqdm | None = None) -> tuple[float, int]:
    """Summed target NLL (nats) and target tokens scored, over every window of the streams.

    Windows are cut like the loader's (window j of a stream starts at token j * seq_len and holds
    seq_len + 1 tokens) and numbered across streams, so on the val shards window k is corrupted with the
    key k, the sample id the trainer's validation uses.
    """
    length = objective.window_len
    seq_len = length - 1
    rows = [np.asarray(s[j * seq_len:j * seq_len + length]) for s in streams for j in range((len(s) - 1) // seq_len)]
    nll, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        keys = np.arange(i, min(i + batch_size, len(rows)), dtype=np.int64)
        src, tgt_in, tgt_out = (t.to(device) for t in objective(np.stack(rows[i:i + batch_size]), keys))
        _, loss = model(src, tgt_in, tgt_out)
        nll += loss.double().item() * tgt_out.numel()  # no padding in a full window: every target counts
        count += tgt_out.numel()
        if progress is not None:
            progress.update(len(keys) * seq_len)
    return nll, count


def unigram_entropy(streams: list[np.ndarray]) -> float:
    """Entropy (nats/token) of the streams' own token frequencies: the loss of the best model that
    ignores context, a baseline a trained model must beat by a wide margin."""
    counts = np.bincount(np.concatenate([np.asarray(s[1:]) for s in streams]).astype(np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _text_tokens(path: Path, tokenizer) -> tuple[np.ndarray, int]:
    """Tokens of a UTF-8 text file with an end-of-text token in front, so its first token is scored too."""
    data = path.read_bytes()
    if not data:
        raise DataError(f"{path}: the file is empty; expected UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 (invalid byte at offset {err.start})") from None
    ids = [tokenizer.eot_token] + tokenizer.encode_ordinary(text)
    return np.asarray(ids, dtype=np.int64), len(data)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lm.eval", description="Evaluate a checkpoint: loss, perplexity (and bits per byte on text).")
    parser.add_argument("--checkpoint", required=True, help="run directory, its checkpoints/ or one step_XXXXXXXX directory")
    parser.add_argument("--text", type=Path, help="score this UTF-8 text file instead of the val shards")
    parser.add_argument("--data-dir", help="shard directory (default: the checkpoint's data.dir)")
    parser.add_argument("--seq-len", type=int, help="window length (default: the checkpoint's data.seq_len)")
    parser.add_argument("--stride", type=int, help="new tokens scored per window (default: seq_len // 2)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, help="read at most this many tokens, from the start of the data")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)

    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        tune_cpu()
    model, cfg, step_dir = load_for_inference(args.checkpoint, device)
    seq_len = args.seq_len or cfg.data.seq_len
    encdec = cfg.model.arch == "encdec"
    if encdec:
        if args.stride is not None:
            parser.error("--stride: applies to decoder-only checkpoints; an encoder-decoder is scored on "
                         "non-overlapping span-corrupted windows")
        if seq_len <= 0:
            parser.error(f"--seq-len: must be positive, got {seq_len}")
        objective = SpanCorruption.from_config(cfg.model, seq_len, cfg.train.seed)
    else:
        if not 0 < seq_len <= cfg.model.block_size:
            parser.error(f"--seq-len: must be in [1, {cfg.model.block_size}] (the model's block_size), got {seq_len}")
        stride = args.stride or max(1, seq_len // 2)
        if not 0 < stride <= seq_len:
            parser.error(f"--stride: must be in [1, {seq_len}] (the window length), got {stride}")

    n_bytes = None
    if args.text is not None:
        tokens, n_bytes = _text_tokens(args.text, load_tokenizer(cfg.data.tokenizer))
        streams, source = [tokens], str(args.text)
    else:
        data_dir = args.data_dir or cfg.data.dir
        manifest = read_manifest(data_dir)
        streams = [open_shard(Path(data_dir) / s["file"]) for s in manifest["splits"]["val"]["shards"]]
        if not streams:
            raise DataError(f"{data_dir}: the val split has no shards; prepare with data.val_fraction > 0")
        source = f"{data_dir} (val)"
    if args.max_tokens:
        kept, left = [], args.max_tokens
        for stream in streams:
            if left < 2:
                break
            kept.append(stream[:left])
            left -= len(kept[-1])
        streams = kept

    total_nll, total_count = 0.0, 0
    with tqdm(total=sum(len(s) - 1 for s in streams), unit="tok", desc="eval", disable=None) as bar:
        if encdec:
            total_nll, total_count = score_span_corruption(model, streams, objective, args.batch_size, device, bar)
        else:
            for stream in streams:
                nll, count = score_stream(model, np.asarray(stream), seq_len, stride, args.batch_size, device, bar)
                total_nll += nll
                total_count += count
    if total_count == 0:
        raise DataError(f"{source}: nothing to score (fewer than {seq_len + 1 if encdec else 2} tokens)")
    loss = total_nll / total_count
    print(f"checkpoint: {step_dir}")
    if encdec:
        s, t = objective.lengths
        print(f"data: {source} | span corruption of windows of {seq_len + 1} tokens (source {s}, target {t})")
        print(f"target tokens scored: {total_count:,}")
    else:
        print(f"data: {source} | window {seq_len}, stride {stride}")
        print(f"tokens scored: {total_count:,}")
    print(f"loss: {loss:.4f} nats/token")
    print(f"perplexity: {math.exp(loss):.3f}")
    # bits per byte and the unigram baseline describe next-token prediction, not span corruption
    if n_bytes is not None and not encdec:
        print(f"bits per byte: {total_nll / math.log(2) / n_bytes:.4f}")
    elif not encdec:
        baseline = unigram_entropy(streams)
        print(f"unigram baseline: {baseline:.4f} nats/token (perplexity {math.exp(baseline):.1f}), "
              "the best loss without context")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))

"""`python -m lm.eval`: loss, perplexity and bits per byte of a checkpoint on val shards or a text file; for a
model trained on another task than next-token prediction, the loss on that task (and, for an encoder, the
accuracy of its masked tokens). With --tasks, a next-token model's accuracy on downstream tasks instead
(HellaSwag, ARC, PIQA, ...: `lm.data.tasks`), split over the ranks under torchrun.

The model family comes from the checkpoint; how each is scored is `lm.inference.scoring`'s docstring, and for
tasks `lm.inference.choices`'.
"""

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from lm.checkpoint.loading import load_for_inference
from lm.checkpoint.run_dir import run_files
from lm.cli import a_path, exit_without_teardown, in_range, positive_int, run
from lm.config import JobConfig
from lm.config.rules import MAX_SEED
from lm.data.objectives import ScoredObjective
from lm.data.tasks import CORE, TASKS, TaskScore, core_score, few_shot_items, load_items, parse_tasks, task_table
from lm.distributed.env import init_device, init_distributed, launched_world_size
from lm.errors import ConfigError, DataError
from lm.inference.choices import encode_items, model_logits_at, score_items
from lm.inference.scoring import first_tokens, score_stream, score_windows, text_tokens, unigram_entropy, val_streams
from lm.io import atomic_write_text, output_file_problem, physical_memory
from lm.models.family import Family
from lm.models.registry import family_of
from lm.tokenizer import model_tokenizer


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lm.eval",
                                     description="Evaluate a checkpoint: loss, perplexity (and bits per byte on text).")
    parser.add_argument("--checkpoint", required=True, type=a_path,
                        help="run directory, its checkpoints/ or one step_XXXXXXXX directory")
    parser.add_argument("--text", type=a_path, help="score this UTF-8 text file instead of the val shards")
    parser.add_argument("--data-dir", type=a_path, help="shard directory (default: the checkpoint's data.dir)")
    parser.add_argument("--seq-len", type=positive_int, help="window length (default: the checkpoint's data.seq_len)")
    parser.add_argument("--stride", type=positive_int, help="new tokens scored per window (default: seq_len // 2)")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--max-tokens", type=positive_int,
                        help="read at most this many tokens, from the start of the data")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    tasks = parser.add_argument_group("downstream tasks (instead of the loss)")
    tasks.add_argument("--tasks", help=f"comma-separated, of {', '.join(TASKS)}; or {CORE} for all of them")
    tasks.add_argument("--limit", type=positive_int,
                       help="score the first N items of each task, in the package's order")
    tasks.add_argument("--shots", type=int, help="solved examples before each item (default 0)")
    tasks.add_argument("--seed", type=in_range(int, 0, MAX_SEED), help="which examples --shots draws (default 0)")
    tasks.add_argument("--json", type=a_path, help="also write the results to this JSON file")
    tasks.add_argument("--force", action="store_true", default=None, help="replace --json if it exists")
    return parser


_LOSS_FLAGS = ("text", "data_dir", "seq_len", "stride", "max_tokens")
_TASK_FLAGS = ("limit", "shots", "seed", "json", "force")


def _document_eot(cfg: JobConfig) -> int | None:
    """A model trained with data.document_mask is scored so too: attention within each document of a window."""
    return model_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size).eot_token if cfg.data.document_mask else None


def _windows(args: argparse.Namespace, cfg: JobConfig, family: Family, parser: argparse.ArgumentParser
             ) -> tuple[int, int | None, ScoredObjective | None]:
    """(window length, stride, objective): a stride for a next-token model, the run's own objective (its masking,
    its span corruption) for the others."""
    seq_len = args.seq_len if args.seq_len is not None else cfg.data.seq_len
    if head := cfg.model.task_head:
        raise ConfigError(f"--checkpoint: {args.checkpoint} is a fine-tuned {cfg.model.arch} (model.head={head}); "
                          "score it on labelled rows with python -m lm.predict")
    if not family.training.causal_lm:
        if args.stride is not None:
            parser.error(f"--stride: applies to next-token checkpoints; {cfg.model.title} is scored on "
                         "non-overlapping windows")
        if not 0 < seq_len <= cfg.model.block_size:
            parser.error(f"--seq-len: must be in [1, {cfg.model.block_size}] (the model's block_size), got {seq_len}")
        try:
            objective = family.training.objective(cfg.model, cfg.data, seq_len, cfg.train.seed, _document_eot(cfg))
            objective.describe(seq_len)  # refuses windows it cannot make
        except ConfigError as err:
            if args.seq_len is None:
                raise
            parser.error(f"--seq-len: {seq_len} does not fit {cfg.model.title}'s objective ({err})")
        return seq_len, None, objective
    if not 0 < seq_len <= cfg.model.block_size:
        parser.error(f"--seq-len: must be in [1, {cfg.model.block_size}] (the model's block_size), got {seq_len}")
    stride = args.stride if args.stride is not None else max(1, seq_len // 2)
    if not 0 < stride <= seq_len:
        parser.error(f"--stride: must be in [1, {seq_len}] (the window length), got {stride}")
    return seq_len, stride, None


def _streams(args: argparse.Namespace, cfg: JobConfig) -> tuple[list[np.ndarray], str, int | None]:
    """The token streams to score, what they are, and the size in bytes of the text they encode (None for shards,
    and for a text that --max-tokens cuts: which of its bytes the kept tokens cover is not known exactly)."""
    n_bytes = None
    if args.text is not None:
        tokens, n_bytes = text_tokens(args.text, model_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size))
        streams, source = [tokens], str(args.text)
    else:
        if cfg.data.mixture and not args.data_dir:
            names = ", ".join(source.dir for source in cfg.data.mixture)
            raise ConfigError(f"--data-dir: {args.checkpoint} trained on a mixture; name the source to score ({names})")
        data_dir = args.data_dir or cfg.data.dir
        streams, source = val_streams(data_dir, cfg.data.tokenizer, cfg.model.vocab_size), f"{data_dir} (val)"
    if args.max_tokens is not None:
        kept = first_tokens(streams, args.max_tokens)
        if n_bytes is not None and sum(map(len, kept)) < len(streams[0]):
            source, n_bytes = f"{source} (its first {args.max_tokens:,} tokens: no bits per byte)", None
        streams = kept
    return streams, source, n_bytes


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.tasks is not None:
        return _main_tasks(args, parser)
    for flag in _TASK_FLAGS:
        if getattr(args, flag) is not None:
            parser.error(f"--{flag.replace('_', '-')}: goes with --tasks")
    if args.text is not None and args.data_dir is not None:
        parser.error("--data-dir: names the shards to score, and --text a file to score instead (drop one of them)")
    device = init_device(args.device, "--device")
    model, cfg, step_dir = load_for_inference(args.checkpoint, device)
    family = family_of(cfg.model)
    seq_len, stride, objective = _windows(args, cfg, family, parser)
    _check_batch_room(args.batch_size, seq_len, cfg, device)
    streams, source, n_bytes = _streams(args, cfg)

    nll, count, correct = 0.0, 0, None
    with tqdm(total=sum(len(s) - 1 for s in streams), unit="tok", desc="eval", disable=None) as bar:
        if objective is not None:
            nll, count, correct = score_windows(family, model, streams, objective, seq_len, args.batch_size, device,
                                                bar)
        else:
            eot = _document_eot(cfg)
            for stream in streams:
                scored = score_stream(model, np.asarray(stream), seq_len, stride, args.batch_size, device, bar,
                                      document_eot=eot)
                nll, count = nll + scored[0], count + scored[1]
    if count == 0:
        raise DataError(f"{source}: nothing to score (fewer than {seq_len + 1 if objective else 2} tokens)")
    print(f"checkpoint: {step_dir}")
    if objective is not None:
        within = " | attention within documents (data.document_mask)" if cfg.data.document_mask else ""
        print(f"data: {source} | {objective.describe(seq_len)}{within}")
        print(f"{objective.targets} scored: {count:,}")
        if correct is not None:
            print(f"{objective.accuracy}: {correct / count:.4f}")
    else:
        masked = " | attention within documents (data.document_mask)" if cfg.data.document_mask else ""
        print(f"data: {source} | window {seq_len}, stride {stride}{masked}")
        print(f"tokens scored: {count:,}")
    _print_loss(nll, count, n_bytes, streams if objective is None else None)
    return 0


def _main_tasks(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Score --tasks; under torchrun every rank scores its share of the items and rank 0 prints the table."""
    for flag in _LOSS_FLAGS:
        if getattr(args, flag) is not None:
            parser.error(f"--{flag.replace('_', '-')}: scores the loss; --tasks scores tasks (drop one of them)")
    args.shots, args.seed = args.shots or 0, args.seed or 0
    if args.shots < 0:
        parser.error(f"--shots: must be 0 or more, got {args.shots}")
    names = parse_tasks(args.tasks, "--tasks")
    inputs = [Path(args.checkpoint), *run_files(args.checkpoint)]
    if args.json is not None and (problem := output_file_problem(args.json, inputs)):
        parser.error(f"--json {problem}")
    if args.json is not None and args.json.exists() and not args.force:  # a data file, a tokenizer, earlier results
        parser.error(f"--json {args.json}: exists; pass --force to replace it")
    items = {name: few_shot_items(load_items(name, args.limit), args.shots, args.seed) for name in names}  # checked
    env = init_distributed(args.device) if launched_world_size() > 1 else None
    device = env.device if env is not None else init_device(args.device, "--device")
    model, cfg, source = load_for_inference(args.checkpoint, device)
    if not family_of(cfg.model).training.causal_lm:
        raise ConfigError(f"--tasks: scores a next-token model by the likelihood of each choice; {args.checkpoint} "
                          f"is {cfg.model.title}")
    model.eval()
    _check_batch_room(args.batch_size, cfg.model.block_size, cfg, device)  # a pair is at most a window long
    tokenizer = model_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
    rank, ranks = (env.rank, env.world_size) if env is not None else (0, 1)
    scores = {}
    for name, task_items in items.items():
        score = score_items(model_logits_at(model, model), encode_items(tokenizer, task_items), task_items,
                            cfg.model.block_size, tokenizer.n_vocab, args.batch_size, device, rank, ranks)
        if env is not None:  # the ranks' sums added
            score = TaskScore.from_list([sum(v) for v in zip(*env.all_gather_object(score.as_list()))])
        scores[name] = score
    if rank == 0:
        shots = f", {args.shots}-shot (seed {args.seed})" if args.shots else ", zero-shot"
        print(f"checkpoint: {source}{shots}")
        print(task_table(scores))
        if args.json is not None:
            results = {"checkpoint": str(source), "shots": args.shots, "seed": args.seed,
                       "tasks": {n: {"items": s.items, **s.metrics()} for n, s in scores.items()},
                       CORE: core_score(scores)}
            atomic_write_text(args.json, json.dumps(results, indent=2) + "\n")
    return 0


def _check_batch_room(batch_size: int, length: int, cfg: JobConfig, device: torch.device) -> None:
    """Refuse, on a CPU, a --batch-size whose float32 logits (and their log-softmax) of `length` positions each exceed
    this machine's memory: allocated, they end the tool in an allocator's traceback, or the kernel kills it. A
    GPU's allocator says so itself."""
    per_window = 2 * 4 * length * cfg.model.padded_vocab_size
    if device.type == "cpu" and batch_size * per_window > physical_memory():
        raise ConfigError(f"--batch-size: {batch_size:,} sequences of {length} positions need "
                          f"{batch_size * per_window / 2**30:,.1f} GiB for their logits, more than this machine's "
                          f"{physical_memory() / 2**30:,.1f} GiB; use at most {physical_memory() // per_window:,}")


def _print_loss(nll: float, count: int, n_bytes: int | None, decoder_streams: list[np.ndarray] | None) -> None:
    """Loss and perplexity; for a decoder, bits per byte of a text or the unigram baseline of shards (both
    describe next-token prediction, not span corruption)."""
    loss = nll / count
    print(f"loss: {loss:.4f} nats/token")
    print(f"perplexity: {math.exp(loss):.3f}")
    if decoder_streams is None:
        return
    if n_bytes is not None:
        print(f"bits per byte: {nll / math.log(2) / n_bytes:.4f}")
    else:
        baseline = unigram_entropy(decoder_streams)
        print(f"unigram baseline: {baseline:.4f} nats/token (perplexity {math.exp(baseline):.1f}), "
              "the best loss without context")


if __name__ == "__main__":
    # a torchrun of --tasks leaves its process group open (the ends of lm.training.job's docstring say why)
    exit_without_teardown(run(main))

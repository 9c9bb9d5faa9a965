"""`python -m lm.predict`: a fine-tuned head's predictions for every row of a CSV/JSONL/parquet file.

    python -m lm.predict --checkpoint runs/lines --file data/lines_test.csv --out preds.jsonl

Writes one JSON line per row, in the file's order: {"row", "prediction"} plus, for a classifier, each class's
probability. When the file has the label column (the run's task.label_column unless --label-column says
otherwise), the rows are also scored: loss and accuracy/macro-F1 or MSE/Pearson's r, computed as
validation computes them.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from lm.checkpoint.loading import load_for_inference
from lm.checkpoint.run_dir import run_files
from lm.checkpoint.store import enclosing_checkpoint, step_store
from lm.checkpoint.trunk import saved_config
from lm.cli import a_path, in_range, run
from lm.data.labelled import encode_examples, example_batches, read_labelled, read_texts
from lm.distributed.env import init_device
from lm.errors import ConfigError, LMError
from lm.io import atomic_path, output_file_problem
from lm.models.registry import family_of
from lm.tokenizer import is_tokenizer_file, model_tokenizer
from lm.training.evaluate import task_metrics, task_sums, task_sums_size

MAX_BATCH = 1 << 20
"""The largest --batch-size: more rows than a file of any sensible size holds; a larger one is a typo."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lm.predict",
                                     description="Predict (and score, when labelled) the rows of a file with a "
                                                 "fine-tuned encoder.")
    parser.add_argument("--checkpoint", required=True, type=a_path,
                        help="a fine-tuning run directory, its checkpoints/, a step directory or a consolidated file")
    parser.add_argument("--file", required=True, type=a_path, help="a .csv, .jsonl/.json or .parquet file")
    parser.add_argument("--out", type=a_path, help="write the predictions here as JSON lines (default: none written)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--text-column", help="column of the texts (default: the run's task.text_column)")
    parser.add_argument("--label-column",
                        help="column of the labels (default: the run's task.label_column); '' scores nothing")
    parser.add_argument("--batch-size", type=in_range(int, 1, MAX_BATCH), default=32,
                        help="rows per forward (default 32)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    return parser


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.text_column == "":
        parser.error("--text-column: empty; name the column of the texts (default: the run's task.text_column)")
    if args.out is not None:
        inputs = [args.file, step_store(args.checkpoint), *run_files(args.checkpoint), *_run_inputs(args.checkpoint)]
        if problem := output_file_problem(args.out, inputs):
            raise ConfigError(f"--out {problem}")
        if (step := enclosing_checkpoint(args.out)) is not None:
            raise ConfigError(f"--out {args.out}: is inside the checkpoint {step}; write the predictions elsewhere")
        if args.out.exists() and not args.force:
            raise ConfigError(f"--out {args.out}: exists; pass --force to replace it")
    device = init_device(args.device, "--device")
    model, cfg, source = load_for_inference(args.checkpoint, device)
    head = cfg.model.task_head
    if head is None:
        raise ConfigError(f"--checkpoint: {source} holds {cfg.model.title} (model.arch={cfg.model.arch}) pretrained "
                          "on token shards; lm.predict takes a fine-tuned head (model.head classify or regress: "
                          "lm.finetune)")
    family = family_of(cfg.model)
    text_column = cfg.task.text_column if args.text_column is None else args.text_column
    label_column = cfg.task.label_column if args.label_column is None else args.label_column
    labels = None
    if label_column:
        # a file only scored may lack a class: that says nothing against it; and without --label-column it
        # may lack the run's label column: then it is predicted, not scored
        texts, labels = read_labelled(args.file, text_column, label_column, head, cfg.model.num_classes,
                                      every_class=False, labels_optional=args.label_column is None)
    else:
        texts = read_texts(args.file, text_column)
    scored = labels is not None
    if labels is None:
        labels = np.zeros(len(texts), dtype=np.int64 if head == "classify" else np.float64)
    tokenizer = model_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
    examples = encode_examples(texts, tokenizer.encode_ordinary, cfg.model.cls_id, cfg.data.seq_len)

    outputs, sums = [], np.zeros(task_sums_size(head, cfg.model.num_classes))
    center = float(labels[0])  # every batch's sums about one target (`regression_sums`)
    with torch.no_grad(), tqdm(total=len(examples), unit="row", desc="predict", disable=None) as bar:
        # one process: no batch is padded past the rows to keep ranks in step
        batch_size = min(args.batch_size, len(examples))
        for ids, batch_labels, keep, weight in example_batches(examples, labels, batch_size, 0, 1, cfg.model.pad_id):
            ids_t, keep_t = (torch.from_numpy(a).to(device) for a in (ids, keep))
            out = family.training.head.outputs(model, model, ids_t, keep_t).float().cpu()
            real = int(weight.sum())
            outputs.append(out[:real])
            sums += task_sums(head, cfg.model.num_classes, out, batch_labels, weight, center)
            bar.update(real)
    outputs = torch.cat(outputs)
    print(f"checkpoint: {source}")
    print(f"file: {args.file} | {len(texts):,} rows | model.head={head}")
    if args.out is not None:
        _write(args.out, head, outputs)
        print(f"predictions: {args.out}")
    if scored:
        for key, value in task_metrics(head, cfg.model.num_classes, sums).items():
            print(f"{key.removeprefix('val/')}: " + ("n/a (the labels or the predictions are constant)"
                                                    if value is None else f"{value:.4f}"))
    return 0


def _run_inputs(checkpoint: str) -> list[Path]:
    """The files the fine-tuning run of `checkpoint` reads (its labelled task.file, a tokenizer.json), which
    predictions must not replace, if its config can be read; loading the checkpoint says what is wrong otherwise."""
    try:
        cfg = saved_config(Path(checkpoint))
    except LMError:
        return []
    files = [cfg.task.file] if cfg.task.file else []
    if is_tokenizer_file(cfg.data.tokenizer):
        files.append(cfg.data.tokenizer)
    return [Path(file) for file in files]


def _write(path: Path, head: str, outputs: torch.Tensor) -> None:
    """One JSON line per row: the predicted class and every class's probability, or the predicted number."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for row, out in enumerate(outputs):
            if head == "classify":
                probs = torch.softmax(out, -1)
                line = {"row": row, "prediction": int(probs.argmax()),
                        "probabilities": [round(p, 6) for p in probs.tolist()]}
            else:
                line = {"row": row, "prediction": float(out)}
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    sys.exit(run(main))

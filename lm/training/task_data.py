"""The data a fine-tuning run trains on: task.file's labelled rows, tokenized, split into train and val, and
the loader over the train rows (`lm.data.labelled`). The counterpart of `lm.training.token_data` for token shards."""

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lm.config import JobConfig
from lm.data.labelled import ExampleLoader, encode_examples, read_labelled, split_examples
from lm.distributed.env import DistEnv
from lm.errors import DataError
from lm.tokenizer import model_tokenizer
from lm.training.token_data import check_batch_split


@dataclass
class TaskData:
    kind: str
    """classify or regress (model.head)"""
    num_classes: int
    """classify: the number of classes; regress: 0"""
    loader: ExampleLoader
    val_examples: list[np.ndarray]
    """Token ids of each val row, [CLS] first"""
    val_labels: np.ndarray
    """(n_val,) int64 classes or float32 targets"""
    content_hash: str
    """sha256 of task.file's bytes"""
    source: str
    train_examples: int

    is_mixture = False
    sources: tuple = ()

    def identity(self) -> dict:
        """What state.json records of the data (`lm.checkpoint.resume.check_data` compares it): the labelled
        file's content hash, its path, and the training rows (in place of a token count)."""
        return {"content_hash": self.content_hash, "source": self.source, "train_tokens": self.train_examples}


def read_task_rows(cfg: JobConfig, path: str | Path) -> tuple[list[np.ndarray], np.ndarray]:
    """Every row of a labelled file as token ids ([CLS] + text, at most data.seq_len ids) and its labels,
    checked against the model's head (`read_labelled`)."""
    texts, labels = read_labelled(Path(path), cfg.task.text_column, cfg.task.label_column, cfg.model.task_head,
                                  cfg.model.num_classes)
    tokenizer = model_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
    return encode_examples(texts, tokenizer.encode_ordinary, cfg.model.cls_id, cfg.data.seq_len), labels


def open_task_data(cfg: JobConfig, env: DistEnv) -> TaskData:
    """Read task.file (every rank reads it: a few MB of text at most), hold out task.val_fraction of its rows,
    and open this rank's loader over the rest."""
    check_batch_split(cfg, env)
    path = Path(cfg.task.file)
    examples, labels = read_task_rows(cfg, path)
    train_idx, val_idx = split_examples(len(examples), cfg.task.val_fraction, "task.val_fraction")
    if len(train_idx) < cfg.train.batch_size:
        raise DataError(f"task.file: {path} has {len(train_idx)} training rows after holding out "
                        f"task.val_fraction={cfg.task.val_fraction}, fewer than one batch "
                        f"(train.batch_size={cfg.train.batch_size})")
    loader = ExampleLoader([examples[i] for i in train_idx], labels[train_idx], cfg.train.seed, env.dp_rank,
                           env.dp_size, cfg.train.batch_size, cfg.train.micro_batch_size, cfg.model.pad_id)
    return TaskData(cfg.model.task_head, cfg.model.num_classes, loader, [examples[i] for i in val_idx], labels[val_idx],
                    hashlib.sha256(path.read_bytes()).hexdigest(), str(path), len(train_idx))

"""Shared pytest fixtures. The data fixtures live here; others may add fixtures for their own areas."""

import gc
import importlib
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lm.data.config import DataConfig
from lm.data.corpora import clean_markdown, find_corpus
from lm.data.prepare import prepare

# tests.budget: the 10 slowest tests and a time budget for the run (LM_TEST_BUDGET_S); pytester: pytest inside a test
pytest_plugins = ["tests.budget", "pytester"]

# DeepSpeed calls torch.distributed functions that torch has deprecated, and every call warns: in the output
# of a failed torchrun those lines bury the error. The tools' own processes inherit this filter.
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")


@pytest.fixture(scope="session")
def tiny_corpus_dir(tmp_path_factory) -> Path:
    """Macbeth (cleaned), one .txt document per scene (the first also holds the title): 28 files,
    ~100 KB, ~31 K gpt2 tokens."""
    play = next(p for p in find_corpus("shakespeare").files if p.name == "macbeth.md")
    scenes = re.split(r"(?m)^(?=### )", play.read_text())
    corpus = tmp_path_factory.mktemp("tiny_corpus")
    for i, scene in enumerate(scenes):
        (corpus / f"scene_{i:02d}.txt").write_text(clean_markdown(scene))
    return corpus


@pytest.fixture(scope="session")
def tiny_data_config(tiny_corpus_dir, tmp_path_factory) -> DataConfig:
    """The DataConfig that `tiny_data_dir` was prepared with (gpt2, val_fraction 0.1, 4096-token shards)."""
    return DataConfig(
        source=str(tiny_corpus_dir / "*.txt"), tokenizer="gpt2", dir=str(tmp_path_factory.mktemp("tiny") / "data"),
        val_fraction=0.1, shard_tokens=4096, num_workers=2, seq_len=16,
    )


@pytest.fixture(scope="session")
def tiny_data_dir(tiny_data_config) -> Path:
    """A data dir prepared through the real `prepare` path (with 2 tokenizer threads) from Macbeth's
    28 scenes: tokenizer gpt2 (uint16 shards, eot 50256), val_fraction 0.1 -> 26 train scenes,
    25,450 tokens in 7 shards (6 x 4096 + 874), and 2 val scenes, 5,703 tokens in 2 shards (4096 + 1607).
    At seq_len 16 that is 1,584 train and 355 val windows; any seq_len below 4096 leaves some.
    Treat it as read-only: the whole session shares it."""
    prepare(tiny_data_config)
    return Path(tiny_data_config.dir)


@pytest.fixture(scope="session")
def trained_run(tiny_data_dir, tmp_path_factory) -> Path:
    """A run directory holding a 2-layer, d=32 GPT trained for 4 steps on `tiny_data_dir` (block 32,
    seq_len 16), with its final checkpoint at step 4. Read-only, shared by the session."""
    from lm.config import load_config
    from lm.distributed.env import init_distributed
    from lm.training.trainer import Trainer

    out = tmp_path_factory.mktemp("trained") / "run"
    cfg = load_config(None, [
        "--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=32",
        "--data.seq_len=16", f"--data.dir={tiny_data_dir}", "--train.steps=4", "--train.batch_size=4",
        "--train.micro_batch_size=2", "--train.device=cpu", "--train.eval_batches=2",
        "--log.tensorboard=false", f"--train.out_dir={out}",
    ])
    Trainer(cfg, init_distributed("cpu")).fit()
    return out


ENCODER = ["--model.arch=encoder", "--model.n_layer=2", "--model.n_head=2", "--model.d_model=32",
           "--model.block_size=32", "--data.seq_len=16"]
"""The tiny encoder of `encoder_run` (gpt2 ids, so it reads `tiny_data_dir`)."""


@pytest.fixture(scope="session")
def encoder_run(tiny_data_dir, tmp_path_factory) -> Path:
    """A run directory holding the tiny `ENCODER` pretrained by masked LM for 6 steps on `tiny_data_dir`
    (the default masking: 30%, 80/10/10), its checkpoints at steps 3 and 6; val every 3 steps over 2 micro-batches
    of 2 windows. Read-only, shared by the session."""
    from lm.config import load_config
    from lm.distributed.env import init_distributed
    from lm.training.trainer import Trainer

    out = tmp_path_factory.mktemp("encoder") / "run"
    cfg = load_config(None, [
        *ENCODER, f"--data.dir={tiny_data_dir}", "--train.steps=6", "--train.batch_size=4",
        "--train.micro_batch_size=2", "--train.device=cpu", "--train.eval_batches=2", "--train.eval_every=3",
        "--checkpoint.every=3", "--log.every=1", "--log.tensorboard=false", "--optim.lr=1e-2",
        "--schedule.warmup_steps=2", f"--train.out_dir={out}",
    ])
    Trainer(cfg, init_distributed("cpu")).fit()
    return out


PLUGIN_SPEC = """
import dataclasses
from typing import ClassVar
from lm.models.gpt.config import GPTConfig
from lm.models.registry import get_family, register

@dataclasses.dataclass
class Config(GPTConfig):
    arch: str = "{name}"
    title: ClassVar[str] = "a plugin's GPT"

FAMILY = dataclasses.replace(get_family("gpt"), name="{name}", config_class=Config)
"""
"""The start of a family plugin module (`plugin_dir`): the GPT's spec under the name {name}; the rest of its source
says what it registers."""


@pytest.fixture()
def plugin_dir(tmp_path, monkeypatch) -> Iterator[Path]:
    """A directory on sys.path for model family plugins (LM_FAMILIES; modules named plug_*, `write_plugin`), with
    the family registry put back after the test: the families they registered, and the modules, are forgotten."""
    from lm.models import registry

    monkeypatch.setattr(registry, "_registered", dict(registry._registered))
    monkeypatch.setattr(registry, "_origins", dict(registry._origins))
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    monkeypatch.syspath_prepend(str(plugins))
    yield plugins
    for name in [m for m in sys.modules if m.startswith("plug_")]:
        del sys.modules[name]


def write_plugin(directory: Path, module: str, source: str) -> None:
    """Module `module` (plug_*) of `source` in `plugin_dir`."""
    (directory / f"{module}.py").write_text(source)
    importlib.invalidate_caches()  # the directory's listing is cached from an earlier import


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Rows as a labelled file, the format by the suffix: .csv (a header, then a line per row) or .jsonl."""
    if path.suffix == ".csv":
        import csv

        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="session")
def separable_rows() -> list[dict]:
    """160 labelled lines, separable by their words: class 1 speaks of the court (king, queen, lord, crown),
    class 0 of the sea (ship, wave, sail, storm); 3 to 8 words each, classes in random order."""
    import random

    rng = random.Random(0)
    words = (["ship", "wave", "sail", "storm"], ["king", "queen", "lord", "crown"])
    rows = []
    for _ in range(160):
        label = rng.randrange(2)
        rows.append({"text": " ".join(rng.choice(words[label]) for _ in range(rng.randint(3, 8))), "label": label})
    return rows


@pytest.fixture(scope="session")
def tokenizer_jsons(tiny_corpus_dir, tmp_path_factory) -> dict[str, Path]:
    """Hugging Face tokenizer.json files trained on Macbeth (400 ids each), each alone in its directory:
    "bos": byte-level BPE with <s> (id 0) and </s> (id 1), whose post-processor puts <s> in front (Llama 3's
    way of adding a BOS), no tokenizer_config.json; "eot": byte-level BPE with only <|endoftext|> (id 0), no BOS;
    "metaspace": SentencePiece-style BPE ("▁" marks a text's first word too) with <s>/</s> and a
    tokenizer_config.json naming them with add_bos_token. Read-only, shared by the session."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    text = [p.read_text() for p in sorted(tiny_corpus_dir.glob("*.txt"))]
    paths = {}
    for kind, specials in [("bos", ["<s>", "</s>"]), ("eot", ["<|endoftext|>"]), ("metaspace", ["<s>", "</s>"])]:
        tokenizer = Tokenizer(models.BPE())
        if kind == "metaspace":
            tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
            tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
            alphabet = []
        else:
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tokenizer.decoder = decoders.ByteLevel()
            alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=alphabet,
                                      show_progress=False)
        tokenizer.train_from_iterator(text, trainer)
        if kind == "bos":
            tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
        path = tmp_path_factory.mktemp(f"tokenizer_{kind}") / "tokenizer.json"
        tokenizer.save(str(path))
        if kind == "metaspace":
            bos = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
                   "single_word": False}  # Llama 2's form
            config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "</s>",
                      "add_bos_token": True}
            path.with_name("tokenizer_config.json").write_text(json.dumps(config))
        paths[kind] = path
    return paths


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test file's last test, collect its garbage and freeze what survives (torch, transformers, the
    session's fixtures), so that the garbage collector stops walking those objects again and again: a full
    collection walks every tracked object, several hundred thousand once torch and transformers are in."""
    result = yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        gc.collect()
        gc.freeze()
    return result


@pytest.fixture(scope="session", autouse=True)
def worker_pools():
    """Ends the gloo worker pools (`tests.workers`) that the session's tests started."""
    yield
    from tests.workers import close_pools

    close_pools()

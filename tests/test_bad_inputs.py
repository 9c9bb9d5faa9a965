"""Bad input across config, data, checkpoints and the command line: each case must fail with exit code 2 and
one `error:` line that names what was wrong, and must leave every file of the run and its data as it was.

Each case runs a real tool (`main` of lm.train, lm.prepare, lm.eval, lm.sample, lm.export or lm.consolidate,
through the same `lm.cli.run` as the console script) in a fresh copy of a workspace holding prepared data, a
trained run with one checkpoint, and a consolidated weights file; the workspace is hashed (every directory
and every file's sha256) before and after.
"""

import hashlib
import importlib
import json
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from lm.checkpoint.run_dir import RunLock
from lm.cli import run
from lm.data.shards import HEADER_BYTES
from tests.distributed.test_engines import heads_for

TOOLS = {
    "train": "lm.train", "prepare": "lm.prepare", "eval": "lm.eval", "sample": "lm.sample",
    "export": "lm.export", "consolidate": "lm.consolidate", "plot": "lm.plot", "sweep": "lm.sweep.__main__",
    "layouts": "lm.layouts",
}
TINY = [
    "--model.n_layer=2", "--model.d_model=32", "--model.block_size=32", "--data.seq_len=16",
    "--train.steps=8", "--train.batch_size=4", "--train.micro_batch_size=2", "--train.device=cpu",
    "--train.eval_batches=2", "--log.tensorboard=false", "--log.sample_tokens=4",
]


@pytest.fixture(scope="module")
def workspace(tiny_data_dir, trained_run, tmp_path_factory) -> Path:
    """data/ and data2/ (the tiny prepared data), run/ (the trained tiny GPT, checkpoint at step 4), weights.safetensors
    (its consolidated weights), corpus/ (two text documents) and spare files the cases point tools at."""
    from lm.consolidate import main as consolidate

    ws = tmp_path_factory.mktemp("workspace")
    shutil.copytree(tiny_data_dir, ws / "data")
    shutil.copytree(tiny_data_dir, ws / "data2")  # a second source for the mixture cases
    shutil.copytree(trained_run, ws / "run")
    assert run(consolidate, ["--checkpoint", str(ws / "run"), str(ws / "weights.safetensors")]) == 0
    (ws / "corpus").mkdir()
    for i in range(2):
        (ws / "corpus" / f"doc_{i}.txt").write_text(f"Document {i}. " * 50)
    (ws / "exported").mkdir()
    (ws / "exported" / "config.json").write_text("{}\n")
    (ws / "bad.yaml").write_text("model: [n_layer: 2\n")
    (ws / "list.yaml").write_text("- model\n- data\n")
    (ws / "binary.txt").write_bytes(b"text \xff\xfe then bytes")
    (ws / "twice.yaml").write_text("optim:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    return ws


def digest(root: Path, memo: dict | None = None) -> dict[str, str]:
    """Every path under `root` with its sha256 (files) or "dir": a new, removed or changed entry shows.

    `memo` (a dict kept between calls over one growing workspace) spares reading again a file whose stat is the one
    it was hashed with (`_sha256`)."""
    return {p.relative_to(root).as_posix(): _sha256(p, memo) if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


SETTLED_NS = 1_000_000_000
"""A file last changed this long before it was hashed: any later write gives it a later ctime"""


def _sha256(path: Path, memo: dict | None) -> str:
    """The file's sha256; from `memo` where its device, inode, size, mtime and ctime are those it was hashed with.
    Every write moves the ctime, which no process can set back, but only to the kernel's clock tick: a hash is
    remembered only for a file that had not changed for SETTLED_NS, so a write since then cannot share its ctime."""
    if memo is None:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    st = path.stat()
    stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    known = memo.get(path)
    if known is not None and known[0] == stamp:
        return known[1]
    value = hashlib.sha256(path.read_bytes()).hexdigest()
    if time.time_ns() - st.st_ctime_ns > SETTLED_NS:
        memo[path] = (stamp, value)
    return value


def checkpoint(ws: Path) -> Path:
    return next((ws / "run" / "checkpoints").iterdir())


def flip_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def drop_json_key(path: Path, key: str) -> None:
    data = json.loads(path.read_text())
    del data[key]
    path.write_text(json.dumps(data))


def replace_text(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def set_token(path: Path, position: int, value: int) -> None:
    tokens = np.memmap(path, dtype="<u2", mode="r+", offset=HEADER_BYTES)
    tokens[position] = value
    tokens.flush()


HELD: list[RunLock] = []  # locks the cases' setups take stay held until the test process ends


def hold(run_dir: Path) -> None:
    """Another run's hold on `run_dir` (an OS lock, as a live trainer has it)."""
    HELD.append(RunLock(run_dir))
    HELD[-1].acquire()


@dataclass
class Case:
    id: str
    tool: str
    argv: list[str]
    error: str  # a regex the `error:` line must match ({ws} is the workspace)
    setup: Callable[[Path], None] | None = None

HAND_EDITED = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rope_scaling": {"type": "linear", "factor": 2.0},
}
"""A transformers 5 config.json after the hand edit that extends the context: transformers applies rope_scaling"""


def train(*extra: str, data: str = "{ws}/data", out: str = "{ws}/run") -> list[str]:
    return [*TINY, *heads_for(extra), f"--data.dir={data}", f"--train.out_dir={out}", *extra]


def mixture(dir_a: str, weight_a: object, dir_b: str, weight_b: object) -> str:
    return f"--data.mixture=[{{dir: {dir_a}, weight: {weight_a}}}, {{dir: {dir_b}, weight: {weight_b}}}]"


CASES = [
    # config: the file, its keys and values, and what a resumed run may change
    Case("config: file missing", "train", ["--config", "{ws}/none.yaml", *train()],
         r"--config: no such file '{ws}/none.yaml'"),
    Case("config: not YAML", "train", ["--config", "{ws}/bad.yaml", *train()], r"{ws}/bad.yaml: not valid YAML"),
    Case("config: not a mapping", "train", ["--config", "{ws}/list.yaml", *train()],
         r"{ws}/list.yaml: expected a mapping of sections at the top level"),
    Case("config: unknown key", "train", train("--model.n_layers=3"),
         r"model.n_layers: not a key of a decoder-only GPT \(model.arch=gpt\); did you mean 'n_layer'\? it takes "
         r"\['arch', 'aux_loss_coef', 'bias', 'block_size', "),
    Case("config: a key the family does not read", "train", train("--model.arch=lstm", "--model.pos=rope"),
         r"model.pos: not a key of an LSTM \(model.arch=lstm\); it takes \['arch', 'bias', 'block_size', 'd_model', "
         r"'dropout', 'loss_chunk', 'n_layer', 'tie_embeddings', 'vocab_multiple', 'vocab_size'\]"),
    Case("config: unknown section", "train", train("--optimizer.lr=1e-3"),
         r"optimizer: unknown key; did you mean 'optim'\?"),
    Case("config: wrong type", "train", train("--train.steps=ten"), r"train.steps: expected int, got str 'ten'"),
    Case("config: override without a value form", "train", train("--train.steps"),
         r"--train.steps: overrides take the form --section.key=value"),
    Case("config: impossible value", "train", train("--optim.lr=-1"), r"optim.lr: must be positive, got -1.0"),
    Case("config: unknown engine", "train", train("--parallel.engine=megatron"),
         r"parallel.engine: unknown engine 'megatron'; expected one of \['ddp', 'fsdp', 'deepspeed'\]"),
    Case("config: another engine's option", "train", train("--parallel.zero_stage=2"),
         r"parallel.zero_stage: only the deepspeed engine has it, but parallel.engine is ddp"),
    Case("config: expert parallelism under ddp", "train", train("--model.n_experts=4", "--parallel.ep=2"),
         r"parallel.ep=2: expert parallelism shards the experts with FSDP2; expected parallel.engine=fsdp, got ddp"),
    Case("config: expert parallelism without experts", "train", train("--parallel.engine=fsdp", "--parallel.ep=2"),
         r"parallel.ep=2: the model has no experts to split \(model.n_experts=0\); expected parallel.ep=1"),
    Case("config: experts that do not split over ep", "train",
         train("--parallel.engine=fsdp", "--model.n_experts=6", "--parallel.ep=4"),
         r"parallel.ep=4: its 6 experts \(model.n_experts\) do not split over 4 expert-parallel ranks; expected an ep "
         r"that divides them: 1, 2, 3, 6"),
    Case("config: expert parallelism with a pipeline", "train",
         train("--parallel.engine=fsdp", "--model.n_experts=4", "--parallel.ep=2", "--parallel.pp=2"),
         r"parallel.ep=2: expert parallelism does not combine with parallel.pp or parallel.cp yet"),
    Case("config: more expert-parallel ranks than data-parallel ones", "train",
         train("--parallel.engine=fsdp", "--model.n_experts=4", "--parallel.ep=2", out="{ws}/fresh"),
         r"parallel.ep=2 does not divide the 1 data-parallel rank\(s\) that shard the model \(world size 1 / \(tp 1 "
         r"x cp 1 x pp 1 x dp_replicate 1\)\), which the expert-parallel ranks are taken from; expected one of 1"),
    Case("config: a DeepSpeed JSON value DeepSpeed refuses", "train",
         train("--parallel.engine=deepspeed", "--parallel.zero_stage=2", "--parallel.deepspeed_config={ws}/ds.json",
               out="{ws}/ds-run"),
         r"parallel.deepspeed_config: {ws}/ds.json: DeepSpeedZeroConfig reduce_bucket_size: Input should be a valid "
         r"integer, .* got 'x'",
         setup=lambda ws: (ws / "ds.json").write_text('{"zero_optimization": {"reduce_bucket_size": "x"}}')),
    Case("config: seq_len beyond block_size", "train", train("--data.seq_len=64"),
         r"data.seq_len: 64 exceeds model.block_size=32"),
    Case("config: batch not divisible", "train", train("--train.batch_size=5"),
         r"train.batch_size: 5 is not a multiple of train.micro_batch_size=2"),
    Case("config: model shape changed on resume", "train", train("--model.n_layer=3"),
         r"step_00000004: checkpoint has a different model shape \(model.n_layer: 2 -> 3\)"),
    Case("config: architecture changed on resume", "train", train("--model.arch=encdec"),
         r"step_00000004: checkpoint is a decoder-only GPT \(model.arch=gpt\) but the config asks for an "
         r"encoder-decoder"),
    Case("config: engine family changed on resume", "train",
         train("--parallel.engine=deepspeed", "--parallel.zero_stage=1"),
         r"step_00000004: written by the ddp engine, and parallel.engine is deepspeed; .* \(python -m lm.consolidate"),
    Case("config: resume=never over checkpoints", "train", train("--checkpoint.resume=never"),
         r"checkpoint.resume=never, but {ws}/run/checkpoints already holds checkpoints"),
    Case("config: resume=required without checkpoints", "train",
         train("--checkpoint.resume=required", out="{ws}/new_run"),
         r"checkpoint.resume=required, but {ws}/new_run/checkpoints holds no complete checkpoint"),
    Case("config: init_from missing", "train",
         train("--checkpoint.init_from={ws}/none.safetensors", out="{ws}/new_run"),
         r"{ws}/none.safetensors: no such file"),
    Case("config: learning rate not a number", "train", train("--optim.lr=nan"),
         r"optim.lr: must be a finite number, got 'nan'"),
    Case("config: learning rate infinite", "train", train("--optim.lr=inf"),
         r"optim.lr: must be a finite number, got 'inf'"),
    Case("config: a key given twice in the file", "train", ["--config", "{ws}/twice.yaml", *train()],
         r"{ws}/twice.yaml: key 'lr' is given twice \(lines 2 and 3\); keep one"),
    Case("config: cuda asked for on a machine without one", "train", train("--train.device=cuda"),
         r"train.device: cuda asked for, but torch sees no CUDA device; use cpu \(or auto\)"),
    Case("config: the run inside its data", "train", train(out="{ws}/data/run"),
         r"train.out_dir: '{ws}/data/run' is inside data.dir '{ws}/data'; preparing the data again replaces"),
    Case("config: the data inside its run", "train", train(data="{ws}/run/data"),
         r"data.dir: '{ws}/run/data' is inside train.out_dir '{ws}/run'",
         lambda ws: shutil.copytree(ws / "data", ws / "run/data")),
    Case("config: the run directory held by another run", "train", train(),
         r"train.out_dir: {ws}/run is in use by another run \(pid \d+ on .*, since .*\); wait for it",
         lambda ws: hold(ws / "run")),
    Case("config: init_from of another shape", "train",
         train("--checkpoint.init_from={ws}/weights.safetensors", "--model.d_model=64", out="{ws}/new_run"),
         r"checkpoint.init_from: {ws}/weights.safetensors holds a different model \(model.d_model: 32 -> 64\)"),
    Case("config: a mixture weight below zero", "train", train(mixture("{ws}/data", 1, "{ws}/data2", -1)),
         r"data.mixture\[1\].weight: expected a finite number >= 0, got -1.0"),
    Case("config: mixture weights that sum to zero", "train", train(mixture("{ws}/data", 0, "{ws}/data2", 0)),
         r"data.mixture: the weights sum to 0; give at least one source a positive weight"),
    Case("config: a mixture weight that is not a number", "train",
         train(mixture("{ws}/data", 1, "{ws}/data2", "lots")),
         r"data.mixture\[1\].weight: expected float, got str 'lots'"),
    Case("config: document_mask for the LSTM", "train", train("--data.document_mask=true", "--model.arch=lstm"),
         r"data.document_mask: an LSTM \(model.arch=lstm\) cannot keep attention inside each document of a window; "
         r"set it to false"),
    # the modern recipe's keys (docs/training.md)
    Case("config: unknown optimizer", "train", train("--optim.name=lion"),
         r"optim.name: expected adamw or muon, got 'lion'"),
    Case("config: a Muon key without Muon", "train", train("--optim.muon_lr=0.05"),
         r"optim.muon_lr: only Muon has it, but optim.name is adamw; set optim.name=muon or drop optim.muon_lr"),
    Case("config: Muon under DeepSpeed", "train",
         train("--optim.name=muon", "--parallel.engine=deepspeed", "--parallel.zero_stage=1"),
         r"optim.name: muon runs under parallel.engine ddp or fsdp; DeepSpeed steps its own optimizer"),
    Case("config: Muon without Newton-Schulz steps", "train", train("--optim.name=muon", "--optim.muon_ns_steps=0"),
         r"optim.muon_ns_steps: must be >= 1, got 0"),
    Case("config: float8 on a CPU", "train", train("--train.float8=tensorwise"),
         r"train.float8=tensorwise needs a CUDA GPU of compute capability 8.9 or later \(Ada, Hopper\); this run's "
         r"device is cpu"),
    Case("config: float8 under DeepSpeed", "train",
         train("--train.float8=rowwise", "--parallel.engine=deepspeed", "--parallel.zero_stage=1"),
         r"train.float8=rowwise: DeepSpeed wraps and casts the model itself"),
    Case("config: a negative z-loss", "train", train("--optim.z_loss=-0.1"), r"optim.z_loss: must be >= 0, got -0.1"),
    Case("config: z-loss for the encoder-decoder", "train", train("--optim.z_loss=1e-4", "--model.arch=encdec"),
         r"optim.z_loss: an encoder-decoder \(model.arch=encdec\) adds no z-loss term to its loss; set it to 0"),
    Case("config: optimizer changed on resume", "train", train("--optim.name=muon"),
         r"{ws}/run/checkpoints/step_00000004: its optimizer state is adamw's and optim.name is muon; resume with "
         r"optim.name=adamw"),
    Case("config: a soft-cap below zero", "train", train("--model.logit_softcap=-1"),
         r"model.logit_softcap: must be >= 0 \(0 = off\)"),
    Case("config: a loss chunk below zero", "train", train("--model.loss_chunk=-1"),
         r"model.loss_chunk: must be >= 0 \(0 turns chunking off\), got -1"),
    Case("config: more experts per token than experts", "train",
         train("--model.n_experts=4", "--model.experts_per_token=5"),
         r"model.experts_per_token: 5 experts per token of model.n_experts=4; it must be 1 to 4"),
    Case("config: a balancing bias without experts", "train", train("--model.router_bias_rate=0.001"),
         r"model.router_bias_rate: 0.001 shapes or trains a mixture of experts, and the model is dense; set "
         r"model.n_experts > 0, or drop model.router_bias_rate"),
    Case("config: shared experts of a dense model", "train", train("--model.n_shared_experts=1"),
         r"model.n_shared_experts: 1 shapes or trains a mixture of experts, and the model is dense"),
    Case("config: a sigmoid router told not to renormalise", "train",
         train("--model.n_experts=4", "--model.router=sigmoid", "--model.router_renorm=false"),
         r"model.router_renorm: false keeps the softmax router's own weights, and the sigmoid router always "
         r"rescales its k scores to sum to 1; drop model.router_renorm"),
    # data: prepared shards, their manifest, and the corpus lm.prepare reads
    Case("data: no data directory", "train", train(data="{ws}/nowhere"),
         r"data.dir: no directory '{ws}/nowhere'; run `python -m lm.prepare` first"),
    Case("data: manifest missing", "train", train(),
         r"{ws}/data/manifest.json: no manifest", lambda ws: (ws / "data/manifest.json").unlink()),
    Case("data: manifest not JSON", "train", train(), r"{ws}/data/manifest.json: unreadable manifest \(JSONDecodeError",
         lambda ws: (ws / "data/manifest.json").write_text("{not json")),
    Case("data: shard missing", "train", train(),
         r"{ws}/data/val_00001.bin: listed in {ws}/data/manifest.json but missing",
         lambda ws: (ws / "data/val_00001.bin").unlink()),
    Case("data: shard truncated", "train", train(),
         r"{ws}/data/train_00002.bin: file is 1000 bytes, but its header \(4096 tokens x 2 bytes\) implies 8224",
         lambda ws: truncate(ws / "data/train_00002.bin", 1000)),
    Case("data: shard byte flipped", "train", train("--data.verify_hashes=true"),
         r"{ws}/data/train_00002.bin: sha256 differs from manifest.json",
         lambda ws: flip_byte(ws / "data/train_00002.bin", HEADER_BYTES + 7)),
    Case("data: shard header damaged", "train", train(),
         r"{ws}/data/val_00000.bin: not a token shard: magic b'MMTOKENS', expected b'LMTOKENS'",
         lambda ws: flip_byte(ws / "data/val_00000.bin", 0)),
    Case("data: other tokenizer", "train", train("--data.tokenizer=cl100k_base", "--model.vocab_size=100277"),
         r"{ws}/data: prepared with tokenizer 'gpt2', but data.tokenizer='cl100k_base'"),
    Case("data: changed under the run", "train", train(),
         r"step_00000004 trained on .* \(25,450 train tokens, content hash [0-9a-f]{12}\), but "
         r"data.dir='{ws}/data' now holds 'elsewhere' .* checkpoint.allow_data_change=true",
         lambda ws: edit_json(ws / "data/manifest.json", content_hash="0" * 64, source="elsewhere")),
    Case("data: another seed on resume", "train", train("--train.seed=7"),
         r"{ws}/run/checkpoints/step_00000004 read its samples in the order of train.seed=1337, now 7: the rest of "
         r"its epoch would read again samples it has read, and never others. .* checkpoint.allow_data_change=true"),
    Case("data: other windows on resume", "train", train("--data.seq_len=8"),
         r"step_00000004 read its samples in the order of data.seq_len=16, now 8: "),
    Case("data: a mixture source without shards", "train", train(mixture("{ws}/data", 1, "{ws}/corpus", 1)),
         r"{ws}/corpus/manifest.json: no manifest, so {ws}/corpus holds no prepared data"),
    Case("data: a mixture of two tokenizers", "train", train(mixture("{ws}/data", 1, "{ws}/data2", 1)),
         r"data.mixture: {ws}/data was prepared with tokenizer 'gpt2' \(50257 ids\) but {ws}/data2 with "
         r"'cl100k_base' \(100277 ids\); all sources must share one tokenizer",
         lambda ws: edit_json(ws / "data2/manifest.json", tokenizer="cl100k_base", vocab_size=100277)),
    Case("data: document_mask on data prepared without boundaries", "train", train("--data.document_mask=true"),
         r"{ws}/data/manifest.json: records no document boundaries \(prepared by an older lm\), which "
         r"data.document_mask needs; run the same `python -m lm.prepare` command again",
         lambda ws: drop_json_key(ws / "data/manifest.json", "document_boundaries")),
    Case("data: prepare from files that do not exist", "prepare",
         ["--data.source={ws}/corpus/*.md", "--data.dir={ws}/data"],
         r"data.source: '{ws}/corpus/\*.md' matches no files"),
    Case("data: prepare a non-UTF-8 file", "prepare",
         ["--data.source={ws}/corpus/*.txt,{ws}/binary.txt", "--data.val_fraction=0.5", "--data.dir={ws}/data"],
         r"{ws}/binary.txt: not UTF-8: byte 0xff at offset 5"),
    Case("data: a document separator typed with a backslash, not a newline", "prepare",
         ["--data.source={ws}/corpus/*.txt", "--data.document_separator=\\f", "--data.dir={ws}/data"],
         r"data.document_separator: '\\\\f' holds a backslash escape as two characters; .* YAML double quotes"),
    Case("data: prepare over a run directory", "prepare",
         ["--data.source={ws}/corpus/*.txt", "--data.val_fraction=0.5", "--data.dir={ws}/run"],
         r"data.dir: '{ws}/run' holds files but no manifest.json, so lm.prepare did not make it"),
    Case("data: prepare over a data directory that holds a run", "prepare",
         ["--data.source={ws}/corpus/*.txt", "--data.val_fraction=0.5", "--data.dir={ws}/data", "--force"],
         r"data.dir: '{ws}/data' holds run, which lm.prepare did not write; preparing replaces the whole directory",
         lambda ws: shutil.copytree(ws / "run", ws / "data/run")),
    Case("data: token ids beyond the vocabulary, for eval", "eval",
         ["--checkpoint", "{ws}/run", "--data-dir", "{ws}/data"],
         r"{ws}/data/val_00001.bin: token 65535 at position 10 is not below the vocabulary size 50257",
         lambda ws: set_token(ws / "data/val_00001.bin", 10, 65535)),
    Case("data: verify a flipped shard", "prepare", ["--data.dir={ws}/data", "--verify"],
         r"{ws}/data/val_00001.bin: sha256 differs from manifest.json",
         lambda ws: flip_byte(ws / "data/val_00001.bin", HEADER_BYTES)),
    # checkpoints: the files a save wrote, read by resume and by every tool
    Case("checkpoint: only one, byte flipped", "train", train(),
         r"no usable checkpoint in {ws}/run/checkpoints: {ws}/run/checkpoints/step_00000004/__0_0.distcp: "
         r"sha256 differs from the manifest",
         lambda ws: flip_byte(checkpoint(ws) / "__0_0.distcp", 100)),
    Case("checkpoint: truncated, for eval", "eval", ["--checkpoint", "{ws}/run", "--data-dir", "{ws}/data"],
         r"step_00000004/__0_0.distcp: 100 bytes, manifest says [\d,]+ \(truncated\)",
         lambda ws: truncate(checkpoint(ws) / "__0_0.distcp", 100)),
    Case("checkpoint: state.json not JSON, for sample", "sample", ["--checkpoint", "{ws}/run"],
         r"step_00000004/state.json: not valid JSON \(corrupt\)",
         lambda ws: (checkpoint(ws) / "state.json").write_text("{")),
    Case("checkpoint: manifest not JSON, for export", "export",
         ["--checkpoint", "{ws}/run", "--to", "hf", "{ws}/hf"], r"step_00000004/manifest.json: unreadable \(corrupt\)",
         lambda ws: (checkpoint(ws) / "manifest.json").write_text("[")),
    Case("checkpoint: a file missing, for consolidate", "consolidate",
         ["--checkpoint", "{ws}/run", "{ws}/out.safetensors"],
         r"step_00000004/rng_rank0.pt: missing", lambda ws: (checkpoint(ws) / "rng_rank0.pt").unlink()),
    Case("checkpoint: manifest deleted, for resume", "train", train(),
         r"no usable checkpoint in {ws}/run/checkpoints: {ws}/run/checkpoints/step_00000004: no manifest.json, so "
         r"its files cannot be checked .* checkpoint.allow_unverified=true",
         lambda ws: (checkpoint(ws) / "manifest.json").unlink()),
    Case("checkpoint: loader position edited in state.json", "train", train(),
         r"step_00000004/state.json: sha256 differs from the manifest",
         lambda ws: replace_text(checkpoint(ws) / "state.json", '"position": 16', '"position": 12')),
    Case("checkpoint: no checkpoint at the path", "eval", ["--checkpoint", "{ws}/corpus"],
         r"{ws}/corpus: no complete checkpoint"),
    Case("checkpoint: a config.json whose rope_scaling and rope_parameters disagree", "eval",
         ["--checkpoint", "{ws}/hf", "--data-dir", "{ws}/data"],
         r"{ws}/hf/config.json: LlamaForCausalLM with settings lm cannot reproduce exactly: rope_scaling and "
         r"rope_parameters disagree: rope_type 'linear' against 'default'",
         setup=lambda ws: (ws / "hf").mkdir() or (ws / "hf" / "config.json").write_text(json.dumps(HAND_EDITED))),
    # command line of the tools
    Case("cli: export over an existing directory", "export",
         ["--checkpoint", "{ws}/run", "--to", "hf", "{ws}/exported"],
         r"python -m lm.export: error: {ws}/exported: directory is not empty; pass --force"),
    Case("cli: export into a run's checkpoints/", "export",
         ["--checkpoint", "{ws}/run", "--to", "hf", "--force", "{ws}/run/checkpoints"],
         r"python -m lm.export: error: {ws}/run/checkpoints: holds checkpoints \(step_\*\), which an export there "
         r"would hide from lm's tools"),
    Case("cli: consolidate over an existing file", "consolidate",
         ["--checkpoint", "{ws}/run", "{ws}/weights.safetensors"],
         r"python -m lm.consolidate: error: {ws}/weights.safetensors: exists; pass --force"),
    Case("cli: eval stride beyond the window", "eval",
         ["--checkpoint", "{ws}/run", "--data-dir", "{ws}/data", "--stride", "99"],
         r"python -m lm.eval: error: --stride: must be in \[1, 16\] \(the window length\), got 99"),
    Case("cli: eval batch beyond the machine's memory", "eval",
         ["--checkpoint", "{ws}/run", "--batch-size", "100000000"],
         r"^error: --batch-size: 100,000,000 sequences of 16 positions need [\d,.]+ GiB for their logits, more than "
         r"this machine's [\d,.]+ GiB; use at most [\d,]+$"),
    Case("cli: eval batch size 0", "eval", ["--checkpoint", "{ws}/run", "--batch-size", "0"],
         r"python -m lm.eval: error: argument --batch-size: expected a positive integer, got 0"),
    Case("cli: eval batch size -1", "eval", ["--checkpoint", "{ws}/run", "--batch-size", "-1"],
         r"python -m lm.eval: error: argument --batch-size: expected a positive integer, got -1"),
    Case("cli: eval stride 0", "eval", ["--checkpoint", "{ws}/run", "--stride", "0"],
         r"python -m lm.eval: error: argument --stride: expected a positive integer, got 0"),
    Case("cli: eval max-tokens 0", "eval", ["--checkpoint", "{ws}/run", "--max-tokens", "0"],
         r"python -m lm.eval: error: argument --max-tokens: expected a positive integer, got 0"),
    Case("cli: eval an unknown task", "eval", ["--checkpoint", "{ws}/run", "--tasks", "piqa,hellaswg"],
         r"--tasks: unknown task 'hellaswg'; did you mean 'hellaswag'\? expected some of hellaswag, arc_easy"),
    Case("cli: eval tasks limit 0", "eval", ["--checkpoint", "{ws}/run", "--tasks", "piqa", "--limit", "0"],
         r"python -m lm.eval: error: argument --limit: expected a positive integer, got 0"),
    Case("cli: eval on cuda where there is none", "eval", ["--checkpoint", "{ws}/run", "--device", "cuda"],
         r"error: --device: cuda asked for, but torch sees no CUDA device"),
    Case("cli: sample on cuda where there is none", "sample", ["--checkpoint", "{ws}/run", "--device", "cuda"],
         r"error: --device: cuda asked for, but torch sees no CUDA device"),
    Case("cli: eval a non-UTF-8 text", "eval", ["--checkpoint", "{ws}/run", "--text", "{ws}/binary.txt"],
         r"{ws}/binary.txt: not UTF-8: byte 0xff at offset 5"),
    Case("cli: sample top-p out of range", "sample", ["--checkpoint", "{ws}/run", "--top-p", "2"],
         r"python -m lm.sample: error: --top-p: must be in \(0, 1\], got 2.0"),
    Case("cli: sample prompt file missing", "sample", ["--checkpoint", "{ws}/run", "--prompt-file", "{ws}/none.txt"],
         r"{ws}/none.txt: cannot read: No such file or directory"),
    Case("cli: sample seed past 64 bits", "sample", ["--checkpoint", "{ws}/run", "--seed", str(2**64)],
         r"python -m lm.sample: error: argument --seed: expected an integer in \[0, 9223372036854775807\], got "
         r"'18446744073709551616'"),
    Case("cli: sample temperature too close to 0", "sample", ["--checkpoint", "{ws}/run", "--temperature", "1e-39"],
         r"python -m lm.sample: error: --temperature: 1e-39 is too close to 0: the logits divided by it overflow; 0 "
         r"for greedy, or at least 0.0001"),
    Case("cli: sample more tokens than the context", "sample", ["--checkpoint", "{ws}/run", "--max-new-tokens", "500"],
         r"--max-new-tokens: 500 leaves no room for a prompt in the model's context of 32 tokens"),
    Case("cli: train --nproc without --dry-run", "train", [*train(), "--nproc", "2"],
         r"--nproc: only --dry-run takes it"),
    Case("cli: train --dry-run --gpu-gib 0", "train", [*train(), "--dry-run", "--gpu-gib", "0"],
         r"python -m lm.train: error: argument --gpu-gib: expected a number in \[1, 1e\+06\], got '0'"),
    Case("cli: layouts whose batch does not split over one of them", "layouts",
         ["--layout", "1", "--layout", "4", *[a for a in TINY if not a.startswith(("--train.steps", "--log."))],
          "--model.n_head=4", "--data.dir={ws}/data", "--out", "{ws}/layouts"],  # not the keys lm.layouts sets
         r"--layout 4: train.batch_size: 4 is not a multiple of train.micro_batch_size \(2\) x 4 data-parallel "
         r"replica\(s\) \(world size 4\)"),
    Case("cli: train --dry-run --nproc 0", "train", [*train(), "--dry-run", "--nproc", "0"],
         r"python -m lm.train: error: argument --nproc: expected an integer in \[1, 16777216\], got '0'"),
    # outputs where nothing can be written, refused before any work
    Case("cli: plot below a file", "plot", ["{ws}/run", "--out", "{ws}/weights.safetensors/curves.png"],
         r"--out {ws}/weights.safetensors/curves.png: {ws}/weights.safetensors is a file, not a directory"),
    Case("cli: sweep into a file", "sweep", ["--config", "{ws}/run/config.yaml", "--grid", "optim.lr=1e-3,2e-3",
                                              "--out", "{ws}/binary.txt"],
         r"--out {ws}/binary.txt: is a file; name a directory"),
    Case("cli: export to a name too long for its temporary name", "export",
         ["--checkpoint", "{ws}/run", "--to", "hf", "{ws}/" + "e" * 250],
         r"error: {ws}/e{250}: the name 'e{24}\.\.\.' is 250 bytes; its filesystem takes names of at most 255, and "
         r"lm writes it first under a name 14 bytes longer"),
    Case("cli: eval --json in a directory whose name is too long", "eval",
         ["--checkpoint", "{ws}/run", "--tasks", "piqa", "--limit", "2", "--json", "{ws}/" + "j" * 256 + "/out.json"],
         r"error: --json {ws}/j{256}/out.json: the name 'j{24}\.\.\.' is 256 bytes; its filesystem takes names of "
         r"at most 255$"),
    Case("data: prepare into a data.dir whose name is too long", "prepare",
         ["--data.source={ws}/corpus/*.txt", "--data.val_fraction=0.5", "--data.dir={ws}/" + "d" * 250],
         r"error: data.dir: {ws}/d{250}: the name 'd{24}\.\.\.' is 250 bytes; its filesystem takes names of at most "
         r"255, and lm writes it first under a name 14 bytes longer"),
    Case("cli: layouts below a file", "layouts", ["--layout", "1", "--layout", "2", "--out", "{ws}/binary.txt/runs"],
         r"--out {ws}/binary.txt/runs: {ws}/binary.txt is a file, not a directory"),
]


def only_error_line(err: str) -> str:
    """The one `error:` line that must end what a refused command printed; before it, argparse's usage at most,
    and nothing of a library's (a log line, a warning)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and "error: " in lines[-1], err
    before = lines[:-1]
    if before:  # argparse's usage: "usage: ..." and its indented continuation lines
        assert before[0].startswith("usage: ") and all(line.startswith(" ") for line in before[1:]), err
    return lines[-1]


def test_the_table_covers_every_area():
    assert len(CASES) >= 25
    assert {c.id.split(":")[0] for c in CASES} == {"config", "data", "checkpoint", "cli"}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_by_name_and_changes_no_file(case, workspace, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU machine too runs the CPU cases
    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws)
    if case.setup is not None:
        case.setup(ws)
    monkeypatch.chdir(ws)  # a tool that wrote relative paths would write inside the hashed tree
    before = digest(ws)
    main = importlib.import_module(TOOLS[case.tool]).main
    argv = [a.replace("{ws}", str(ws)) for a in case.argv]
    try:
        code = run(main, argv)
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    line = only_error_line(err)
    assert re.search(case.error.replace("{ws}", re.escape(str(ws))), line), line
    assert digest(ws) == before


RANDOM_TOOL_CASES = 48
"""Seeded random command lines for the tools that read a checkpoint (README's figure of inputs tried counts them)."""
FLAGS = {
    "eval": ["--text", "--data-dir", "--seq-len", "--stride", "--batch-size", "--max-tokens", "--device"],
    "sample": ["--prompt", "--prompt-file", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--num-samples",
               "--seed", "--device"],
    "export": ["--to", "--force"],
    "consolidate": ["--force"],
}
OUTS = {"export": ["{ws}/out", "{ws}/exported", "{ws}/run", "{ws}/weights.safetensors", "{ws}/corpus/doc_0.txt/x",
                   "{ws}/" + "o" * 250],
        "consolidate": ["{ws}/out.safetensors", "{ws}/weights.safetensors", "{ws}/run", "{ws}/o.bin",
                        "{ws}/corpus/doc_0.txt/o.safetensors", "{ws}/" + "o" * 244 + ".safetensors"]}
NUMBERS = ["0", "1", "-1", "2", "7", "33", "1e9", "nan", "inf", "0.5", "x", "", "1e-40", str(2**64), str(-2**63 - 1),
           "1" + "0" * 30]
PATHS = ["{ws}/run", "{ws}/weights.safetensors", "{ws}/corpus/doc_0.txt", "{ws}/binary.txt", "{ws}/none",
         "{ws}/data", "{ws}", ""]
VALUES_OF = {"--text": PATHS, "--data-dir": PATHS, "--prompt-file": PATHS, "--device": ["cpu", "cuda", "auto", "tpu"],
             "--to": ["hf", "gpt2", "llama", ""], "--prompt": ["ROMEO:", "", "x " * 40, "<|endoftext|>", "\u00ff\n"]}
"""Each flag's values: plausible and awkward ones of its kind (a number, for any flag not named here)."""


def random_command(rng: random.Random) -> tuple[str, list[str]]:
    """A tool that reads a checkpoint, the workspace's run or weights, and 1 to 3 of its flags at random values."""
    tool = rng.choice(sorted(FLAGS))
    argv = ["--checkpoint", rng.choice(["{ws}/run", "{ws}/weights.safetensors", "{ws}/run/checkpoints"])]
    for flag in rng.sample(FLAGS[tool], rng.randint(1, min(3, len(FLAGS[tool])))):
        argv += [flag] if flag == "--force" else [flag, rng.choice(VALUES_OF.get(flag, NUMBERS))]
    if tool in OUTS:
        argv.append(rng.choice(OUTS[tool]))
    return tool, argv


@pytest.mark.slow
def test_random_command_lines_end_in_a_result_or_one_error_line(workspace, tmp_path, capsys, monkeypatch):
    """Exit 0, or exit 2 with one `error:` line and no traceback; nothing outside the output changes, and the
    output itself only where --force allows it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rng = random.Random(4)
    ws, before, memo = tmp_path, None, {}  # `before`: what the copy holds while it is as the workspace was, or None
    for i in range(RANDOM_TOOL_CASES):
        tool, argv = random_command(rng)
        if before is None:  # a fresh copy once a case has written to the last: a refusal or a read leaves it as copied
            ws = tmp_path / f"ws{i}"
            shutil.copytree(workspace, ws)
            before = digest(ws, memo)
        monkeypatch.chdir(ws)
        argv = [a.replace("{ws}", str(ws)) for a in argv]
        try:
            code = run(importlib.import_module(TOOLS[tool]).main, argv)
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code
        err = capsys.readouterr().err
        assert "Traceback" not in err and code in (0, 2), (tool, argv, code, err)
        after = digest(ws, memo)
        if code == 2:
            only_error_line(err)
            assert after == before, (tool, argv)
        elif tool in OUTS:
            out = Path(argv[-1]).relative_to(ws).as_posix()
            changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
            assert all(k == out or k.startswith(out + "/") for k in changed), (tool, argv, changed)
            assert "--force" in argv or all(k not in before for k in changed), (tool, argv, changed)
        else:
            assert after == before, (tool, argv)
        before = before if after == before else None

"""A checkpoint, in whatever form, as a model ready to score or sample on one process, or as the weights a
new run starts from (`checkpoint.init_from`)."""

import functools
from pathlib import Path

import torch
import torch.nn as nn

from lm.checkpoint.consolidated import load_consolidated, load_consolidated_weights, read_consolidated_config
from lm.checkpoint.model_weights import load_checkpoint_weights, tied_names
from lm.checkpoint.resume import family_mismatch, model_diff
from lm.checkpoint.store import read_config, resolve_checkpoint
from lm.checkpoint.trunk import trunk_loader
from lm.config import JobConfig, load_config
from lm.distributed.materialize import WeightLoader
from lm.errors import ConfigError
from lm.hf.import_weights import check_hf_weights, load_hf_weights
from lm.hf.importing import HFModel, is_hf_checkpoint
from lm.models.hf_checkpoint import read_hf_model
from lm.models.registry import config_class, family_of


def init_from_loader(path: Path, cfg: JobConfig) -> WeightLoader:
    """The loader that fills a new run's weights from `path` (a consolidated .safetensors file or a Hugging
    Face checkpoint directory), once `path` is known to hold the model the config describes. A fine-tuning
    head (an encoder's classify or regress) starts from an encoder checkpoint's trunk instead (`trunk_loader`)."""
    if cfg.model.task_head:
        return trunk_loader(path, cfg)
    if not path.is_dir():
        saved = read_consolidated_config(path).model
        if mismatch := family_mismatch(saved, cfg.model):
            raise ConfigError(f"checkpoint.init_from: {path} {mismatch}")
        if details := model_diff(saved, cfg.model):
            raise ConfigError(f"checkpoint.init_from: {path} holds a different model ({details})")
        return functools.partial(load_consolidated_weights, path)
    # A transformers checkpoint: the config took its model section from this config.json when it was loaded
    # (lm.config.init_from), so what is left to check is every tensor's name and shape, before the engine
    # allocates the model.
    with torch.device("meta"):
        model = family_of(cfg.model).build(cfg.model)
    source = read_hf_model(path)  # a directory without config.json is refused by name
    check_hf_weights(source, model)
    return functools.partial(load_hf_weights, source)


def load_hf_model(source: HFModel) -> nn.Module:
    """Our model holding the transformers checkpoint `source`, on the CPU in float32, in eval mode. It is built
    on the meta device and allocated without drawing any weight: the files supply every one."""
    cfg = config_class(source.arch)(**source.fields)
    with torch.device("meta"):
        model = family_of(cfg).build(cfg)
    tied = tied_names(model)
    model.to_empty(device="cpu")
    for alias, name in tied.items():  # to_empty gave a tied head storage of its own: share the embedding's again
        module, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(module), attr, model.get_parameter(name))
    load_hf_weights(source, model)
    return model.eval()


def hf_job_config(directory: Path) -> JobConfig:
    """The config of a Hugging Face checkpoint read as it is: its model, its tokenizer.json when it has one,
    and windows no longer than its positions."""
    block_size = read_hf_model(directory).fields["block_size"]
    seq_len = min(JobConfig().data.seq_len, block_size)
    try:
        return load_config(None, [f"--checkpoint.init_from={directory}", f"--data.seq_len={seq_len}"])
    except ConfigError as err:
        if (directory / "tokenizer.json").is_file():
            raise
        raise ConfigError(f"{directory}: has no tokenizer.json, and the default tokenizer does not fit its model "
                          f"({err}); put the checkpoint's tokenizer.json beside its config.json") from None


def load_for_inference(path: str | Path, device: torch.device) -> tuple[nn.Module, JobConfig, Path]:
    """Build the model a checkpoint describes and load its weights; returns (model, config, source).

    `path`: a run directory, its checkpoints/ or one step directory of any engine (DeepSpeed's are
    merged by zero_to_fp32), a consolidated .safetensors file, or a Hugging Face checkpoint directory
    (config.json and safetensors). A step directory is verified against its manifest first: a damaged one
    raises CheckpointError naming the file.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        model, cfg = load_consolidated(path, device)
        return model, cfg, path
    if is_hf_checkpoint(path):
        cfg = hf_job_config(path)
        return load_hf_model(read_hf_model(path)).to(device), cfg, path
    step_dir = resolve_checkpoint(path)
    cfg = read_config(step_dir)
    model = family_of(cfg.model).build(cfg.model)
    load_checkpoint_weights(step_dir, model)
    return model.to(device).eval(), cfg, step_dir

"""A model and its tokenizer written as a transformers directory: config.json, model.safetensors,
generation_config.json and the tokenizer's files, so that `AutoModelForCausalLM.from_pretrained(OUT)` and
`AutoTokenizer.from_pretrained(OUT)` load it offline and give our logits over the tokenizer's ids. A model no
transformers class computes also gets lm's modeling code (`lm.hf.remote_code`), which transformers loads with
`trust_remote_code=True`.
Exporting needs no `transformers`: a tiktoken encoding's files are built as JSON (`lm.hf.tokenizer_files`),
and a model trained with a tokenizer.json gets that file, and the tokenizer_config.json beside it, copied.

An encoder (BertForMaskedLM, `AutoModelForMaskedLM.from_pretrained(OUT)`) is written without tokenizer files:
its [MASK], [CLS] and padding ids come after the tokenizer's, which knows none of them, so the tokenizer's
files as they stand would encode text without the [CLS] the model always saw first, and no fill-mask could
name [MASK]. Encode with the run's tokenizer (data.tokenizer), put `model.cls_id` in front and use
`model.mask_id` and `model.pad_id` (config.json's pad_token_id); `python -m lm.export` prints the three."""

import json
import shutil
from pathlib import Path
from typing import Any

import torch.nn as nn
from safetensors.torch import save_file

from lm.hf.importing import GENERATION_CONFIG, read_config_json
from lm.hf.remote_code import exported_source
from lm.hf.targets import Target, hf_state_dict
from lm.hf.tokenizer_files import write_hf_tokenizer
from lm.io import atomic_path, merge_dir, output_dir_problem, temp_sibling
from lm.tokenizer import HFTokenizer, Tokenizer, is_tokenizer_file
from lm.tokenizer.hf_json import TOKENIZER_CONFIG

__all__ = ["copy_tokenizer_files", "export_hf", "output_problem", "write_export"]


def _write_json(path: Path, content: dict[str, Any]) -> Path:
    path.write_text(json.dumps(content, indent=2) + "\n")
    return path


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_hf(model: nn.Module, target: Target, encoding: Tokenizer | None, tokenizer: str,
              out_dir: Path, origin: Path | None = None) -> list[Path]:
    """Write `model` as the transformers class `target` (its family's, `lm.hf.targets`) and its tokenizer
    (`encoding`, named `tokenizer` in our configs) as a transformers directory into `out_dir`; return the files
    written. The start token is the tokenizer's BOS, or without one its end-of-text (GPT-2's convention).
    `encoding` None writes the model alone (config.json and model.safetensors), as for an encoder.

    `origin`: the transformers files the model was imported from (`lm.hf.importing.find_origin`). Its token
    ids (config.json's bos, eos and pad) and its generation_config.json are written back as they were: chat
    templates and generation settings read them, and lm's choice from the tokenizer may differ."""
    cfg = model.cfg
    eot = encoding.eot_token if encoding is not None and encoding.eot_token < cfg.vocab_size else None
    bos = getattr(encoding, "bos_token", None)
    weights = hf_state_dict(model, target)
    dtype = next(iter(weights.values())).dtype
    out_dir.mkdir(parents=True, exist_ok=True)
    config = target.config(cfg, eot, dtype)
    if bos is not None:
        config["bos_token_id"] = bos
    source = read_config_json(origin)[0] if origin is not None else {}
    config |= {key: source[key] for key in TOKEN_ID_KEYS if key in source}
    written = [_write_json(out_dir / "config.json", config)]
    for path in target.code:  # lm's own modeling code, which config.json's auto_map names
        (out_dir / path.name).write_text(exported_source(path, target.code), encoding="utf-8")
        written.append(out_dir / path.name)
    if origin is not None and (origin / GENERATION_CONFIG).is_file():
        shutil.copyfile(origin / GENERATION_CONFIG, out_dir / GENERATION_CONFIG)
        written.append(out_dir / GENERATION_CONFIG)
    elif target.generation is not None:
        written.append(_write_json(out_dir / GENERATION_CONFIG, target.generation(cfg)))
    elif eot is not None:
        # transformers generate() would otherwise warn and pad finished rows with eos anyway.
        written.append(_write_json(out_dir / "generation_config.json",
                                   {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                                    "pad_token_id": eot}))
    # transformers refuses safetensors files whose metadata does not say which framework wrote them.
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(weights, tmp, metadata={"format": "pt"})
    written.append(out_dir / "model.safetensors")
    if encoding is None:
        return written
    if is_tokenizer_file(tokenizer):
        written += copy_tokenizer_files(encoding, out_dir, cfg.block_size)
    else:
        written += write_hf_tokenizer(encoding, tokenizer, out_dir, cfg.block_size)
    return written


def copy_tokenizer_files(tokenizer: HFTokenizer, out_dir: Path, model_max_length: int) -> list[Path]:
    """The tokenizer.json a model was trained with, and the tokenizer_config.json beside it, copied unchanged, so
    transformers loads the tokenizer of the model it came from. Without a tokenizer_config.json one is written
    that loads tokenizer.json as it stands (PreTrainedTokenizerFast) with the EOS and BOS lm chose."""
    paths = [out_dir / "tokenizer.json", out_dir / TOKENIZER_CONFIG]
    shutil.copyfile(tokenizer.path, paths[0])
    if tokenizer.config_path is not None:
        shutil.copyfile(tokenizer.config_path, paths[1])
        return paths
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tokenizer.id_to_token(tokenizer.eot_token),
        "model_max_length": model_max_length,
        # transformers would otherwise "clean up" decoded text (" ," -> ","), breaking the round trip.
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.bos_token is not None:
        config["bos_token"] = tokenizer.id_to_token(tokenizer.bos_token)
    _write_json(paths[1], config)
    return paths


def write_export(model: nn.Module, target: Target, encoding: Tokenizer | None, tokenizer: str,
                 out: Path, origin: Path | None = None) -> tuple[list[str], list[str]]:
    """`export_hf` into a sibling of `out`, then published: a new `out` appears whole, and into an existing
    one the files move one by one, each replaced atomically, so a failure never leaves half an export.
    Returns the names written and the names of the files `out` already held that it left alone."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = temp_sibling(out)
    staging.mkdir()
    try:
        written = sorted(p.name for p in export_hf(model, target, encoding, tokenizer, staging, origin))
        kept = sorted(p.name for p in out.iterdir() if p.name not in written) if out.is_dir() else []
        merge_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return written, kept


def output_problem(out: Path, force: bool) -> str | None:
    """Why the export may not write into `out`, or None when it may (`output_dir_problem`: it is built beside `out`
    under a temporary name, then moved in)."""
    if problem := output_dir_problem(out, sibling=True):
        return problem
    if out.is_dir() and any(out.iterdir()) and not force:
        return f"{out}: directory is not empty; pass --force to write the export's files into it (other files are kept)"
    return None

"""A model and its tokenizer written as a transformers directory: config.json, model.safetensors,
generation_config.json and the tokenizer's files, so that `AutoModelForCausalLM.from_pretrained(OUT)` and
`AutoTokenizer.from_pretrained(OUT)` load it offline and give our logits over the tokenizer's ids.
Exporting needs neither `transformers` nor `tokenizers`: only safetensors and JSON."""

import json
import shutil
from pathlib import Path
from typing import Any

import tiktoken
from safetensors.torch import save_file

from lm.hf.mapping import hf_config, hf_state_dict
from lm.hf.tokenizer_files import write_hf_tokenizer
from lm.io import atomic_path, merge_dir, temp_sibling
from lm.models.gpt import GPT

__all__ = ["export_hf", "output_problem", "write_export"]


def _write_json(path: Path, content: dict[str, Any]) -> Path:
    path.write_text(json.dumps(content, indent=2) + "\n")
    return path


def export_hf(model: GPT, encoding: tiktoken.Encoding, tokenizer: str, out_dir: Path) -> list[Path]:
    """Write `model` and its tokenizer (`encoding`, named `tokenizer` in our configs) as a transformers
    directory into `out_dir`; return the files written."""
    cfg = model.cfg
    eot = encoding.eot_token if encoding.eot_token < cfg.vocab_size else None
    weights = hf_state_dict(model)
    dtype = next(iter(weights.values())).dtype
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [_write_json(out_dir / "config.json", hf_config(cfg, eot, dtype))]
    if eot is not None:
        # transformers generate() would otherwise warn and pad finished rows with eos anyway.
        written.append(_write_json(out_dir / "generation_config.json",
                                   {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot}))
    # transformers refuses safetensors files whose metadata does not say which framework wrote them.
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(weights, tmp, metadata={"format": "pt"})
    written.append(out_dir / "model.safetensors")
    written += write_hf_tokenizer(encoding, tokenizer, out_dir, cfg.block_size)
    return written


def write_export(model: GPT, encoding: tiktoken.Encoding, tokenizer: str, out: Path) -> tuple[list[str], list[str]]:
    """`export_hf` into a sibling of `out`, then published: a new `out` appears whole, and into an existing
    one the files move one by one, each replaced atomically, so a failure never leaves half an export.
    Returns the names written and the names of the files `out` already held that it left alone."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = temp_sibling(out)
    staging.mkdir()
    try:
        written = sorted(p.name for p in export_hf(model, encoding, tokenizer, staging))
        kept = sorted(p.name for p in out.iterdir() if p.name not in written) if out.is_dir() else []
        merge_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return written, kept


def output_problem(out: Path, force: bool) -> str | None:
    """Why the export may not write into `out`, or None when it may."""
    if out.exists() and not out.is_dir():
        return f"{out}: exists and is not a directory"
    if out.is_dir() and any(out.iterdir()) and not force:
        return f"{out}: directory is not empty; pass --force to write the export's files into it (other files are kept)"
    return None

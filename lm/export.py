"""`python -m lm.export --checkpoint RUN --to hf OUT`: a checkpoint as a Hugging Face transformers model.

OUT gets config.json, model.safetensors, generation_config.json and the tokenizer's files, so that
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)` load
it offline and give our logits over the tokenizer's ids. The model config picks the target:

- GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, GELU, biases, multi-head attention, pre-norm.
- Llama (`LlamaForCausalLM`): rotary positions, RMSNorm, SwiGLU, pre-norm; any number of key/value
  heads, with or without biases.

Any other combination is refused before anything is loaded or written, naming the keys that differ.
The mapping functions (`hf_config`, `gpt2_state_dict`, `llama_state_dict`) are pure, so the parity
tests feed the same tensors to transformers that the export writes. Exporting needs neither
`transformers` nor `tokenizers`: only safetensors and JSON.
"""

import argparse
import json
import logging
import os
import secrets
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tiktoken
import torch
from safetensors.torch import save_file

from lm.checkpoint import load_for_inference, read_config, resolve_checkpoint
from lm.cli import run
from lm.config import JobConfig
from lm.consolidate import read_consolidated_config
from lm.hf_tokenizer import write_hf_tokenizer
from lm.models.config import ConfigError, ModelConfig
from lm.models.gpt import GPT
from lm.tokenizer import load_tokenizer

__all__ = [
    "ExportError", "TARGETS", "export_hf", "gpt2_state_dict", "hf_config", "hf_state_dict", "hf_target",
    "llama_state_dict", "output_problem", "publish", "unmet",
]

log = logging.getLogger("lm.export")


class ExportError(ConfigError):
    """The model config has no Hugging Face counterpart; the message names the keys and what each target needs."""


@dataclass(frozen=True)
class Need:
    """One condition a target puts on the model config: `key` must be `wanted` (as one writes it on the CLI)."""

    key: str
    wanted: str
    ok: Callable[[ModelConfig], bool]


def _yaml(value: object) -> str:
    """A config value as it is written in YAML or on the command line (`false`, not `False`)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _equals(key: str, value: object) -> Need:
    return Need(key, _yaml(value), lambda cfg: getattr(cfg, key) == value)


@dataclass(frozen=True)
class Target:
    """A transformers causal LM class, and what our model config must be for its forward to equal ours."""

    name: str
    hf_class: str
    needs: tuple[Need, ...]


# Only options a transformers class reproduces exactly are accepted. Knobs the class has in its config
# (GPT-2's n_inner and tie_word_embeddings, Llama's biases and key/value heads) are passed through; options
# it has no knob for (a post-norm block, rmsnorm with learned positions) are refused rather than approximated.
TARGETS: dict[str, Target] = {
    "gpt2": Target("GPT-2", "GPT2LMHeadModel", (
        _equals("arch", "gpt"), _equals("pos", "learned"), _equals("norm", "layernorm"), _equals("mlp", "gelu"),
        _equals("norm_position", "pre"), _equals("bias", True),
        # GPT-2 attention has no grouped-query option: every query head has its own key/value head.
        Need("n_kv_head", "0 (one key/value head per query head)", lambda cfg: cfg.kv_heads == cfg.n_head),
    )),
    "llama": Target("Llama", "LlamaForCausalLM", (
        _equals("arch", "gpt"), _equals("pos", "rope"), _equals("norm", "rmsnorm"), _equals("mlp", "swiglu"),
        _equals("norm_position", "pre"),
    )),
}


def unmet(cfg: ModelConfig, target: Target) -> list[Need]:
    """The conditions of `target` that `cfg` does not meet, in the target's order."""
    return [need for need in target.needs if not need.ok(cfg)]


def hf_target(cfg: ModelConfig) -> str:
    """The key of TARGETS that reproduces `cfg` ("gpt2" or "llama"); ExportError when none does.

    The message lists the model keys in the way of an export and, per target, the values it needs.
    """
    if cfg.arch == "lstm":  # it ignores the position, norm and MLP keys, so listing them would mislead
        raise ExportError("cannot export to Hugging Face: model.arch=lstm is a recurrent model and the targets are "
                          "transformers (GPT2LMHeadModel and LlamaForCausalLM need model.arch=gpt)")
    misses = {name: unmet(cfg, target) for name, target in TARGETS.items()}
    for name, missed in misses.items():
        if not missed:
            return name
    keys = list(dict.fromkeys(need.key for missed in misses.values() for need in missed))
    have = ", ".join(f"model.{key}={_yaml(getattr(cfg, key))}" for key in keys)
    per_target = "; ".join(
        f"{TARGETS[name].hf_class} ({TARGETS[name].name}) needs "
        + ", ".join(f"model.{need.key}={need.wanted}" for need in missed)
        for name, missed in misses.items()
    )
    raise ExportError(f"cannot export to Hugging Face: no transformers model has this combination "
                      f"({have}): {per_target}")


def _require(cfg: ModelConfig, name: str) -> None:
    found = hf_target(cfg)
    if found != name:
        raise ExportError(f"this model maps to {TARGETS[found].hf_class}, not {TARGETS[name].hf_class}")


def hf_config(cfg: ModelConfig, eos_token_id: int | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json for the transformers class that reproduces `cfg`, as a JSON-ready dict.

    `eos_token_id` (our end-of-text id) also serves as the start token, as in GPT-2. The vocabulary is
    the tokenizer's (`cfg.vocab_size`): our embedding's padding rows are never produced by the
    tokenizer, so dropping them leaves the logits of every real id unchanged.
    """
    name = hf_target(cfg)
    common = {
        "architectures": [TARGETS[name].hf_class],
        "vocab_size": cfg.vocab_size,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if name == "gpt2":
        return {
            "model_type": "gpt2",
            **common,
            "n_positions": cfg.block_size,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_inner": cfg.ff_dim,
            "activation_function": "gelu_new",  # the tanh approximation our MLP uses
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
            "layer_norm_epsilon": cfg.norm_eps,
            "scale_attn_weights": True,
        }
    return {
        "model_type": "llama",
        **common,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ff_dim,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 5 reads rope_parameters; 4.x reads the top-level rope_theta and ignores the dict.
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        # Llama has dropout on attention weights only; ours also drops residuals and embeddings in training.
        "attention_dropout": cfg.dropout,
        "pretraining_tp": 1,
    }


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with its own storage: safetensors refuses tensors that share memory, such as
    the row slices of our fused q/k/v matrix."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def _head(model: GPT, prefix: str) -> dict[str, torch.Tensor]:
    """Embedding (and an untied output head) cut to the tokenizer's vocabulary."""
    cfg, V = model.cfg, model.cfg.vocab_size
    out = {f"{prefix}.weight": model.wte.weight[:V]}
    if not cfg.tie_embeddings:  # tied: transformers re-ties lm_head to the embedding on load
        out["lm_head.weight"] = model.lm_head.weight[:V]
    return out


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """`GPT2LMHeadModel` weights of a GPT-2-style `model`, each a standalone contiguous tensor.

    transformers' GPT-2 uses Conv1D layers, whose weights are stored (in, out): our nn.Linear weights
    (out, in) are transposed. The fused q/k/v rows [q; k; v] become c_attn's columns in the same order.
    """
    cfg = model.cfg
    _require(cfg, "gpt2")
    sd = model.state_dict()
    out = {**_head(model, "transformer.wte"), "transformer.wpe.weight": sd["wpe.weight"]}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("ln_1", "ln_1"), ("ln_2", "ln_2"), ("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                     ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            weight = sd[ours + a + ".weight"]
            out[theirs + b + ".weight"] = weight if a.startswith("ln") else weight.t()
            out[theirs + b + ".bias"] = sd[ours + a + ".bias"]
    out["transformer.ln_f.weight"] = sd["ln_f.weight"]
    out["transformer.ln_f.bias"] = sd["ln_f.bias"]
    return {k: _own(v) for k, v in out.items()}


def llama_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """`LlamaForCausalLM` weights of a Llama-style `model`, each a standalone contiguous tensor.

    Our fused q/k/v rows [q heads; k heads; v heads] split into q_proj, k_proj and v_proj, and the SwiGLU
    rows [gate; up] into gate_proj and up_proj. Both use rotary's half-split layout, so no row is permuted.
    """
    cfg = model.cfg
    _require(cfg, "llama")
    sd = model.state_dict()
    q_rows, kv_rows = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    params = ("weight", "bias") if cfg.bias else ("weight",)
    out = _head(model, "model.embed_tokens")
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for p in params:
            q, k, v = sd[f"{ours}attn.qkv.{p}"].split([q_rows, kv_rows, kv_rows])
            gate, up = sd[f"{ours}mlp.fc.{p}"].chunk(2)
            out.update({
                f"{theirs}self_attn.q_proj.{p}": q, f"{theirs}self_attn.k_proj.{p}": k,
                f"{theirs}self_attn.v_proj.{p}": v, f"{theirs}self_attn.o_proj.{p}": sd[f"{ours}attn.proj.{p}"],
                f"{theirs}mlp.gate_proj.{p}": gate, f"{theirs}mlp.up_proj.{p}": up,
                f"{theirs}mlp.down_proj.{p}": sd[f"{ours}mlp.proj.{p}"],
            })
        out[f"{theirs}input_layernorm.weight"] = sd[f"{ours}ln_1.weight"]
        out[f"{theirs}post_attention_layernorm.weight"] = sd[f"{ours}ln_2.weight"]
    out["model.norm.weight"] = sd["ln_f.weight"]
    return {k: _own(v) for k, v in out.items()}


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The transformers weights of `model`, for whichever target its config maps to."""
    return gpt2_state_dict(model) if hf_target(model.cfg) == "gpt2" else llama_state_dict(model)


def _write_json(path: Path, content: dict[str, Any]) -> Path:
    path.write_text(json.dumps(content, indent=2) + "\n")
    return path


def export_hf(model: GPT, job: JobConfig, encoding: tiktoken.Encoding, out_dir: Path) -> list[Path]:
    """Write `model` and its tokenizer as a transformers directory into the existing `out_dir`; return the files."""
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
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    # safetensors creates its file private (0600); give it the permissions of the files written above.
    shutil.copymode(written[0], out_dir / "model.safetensors")
    written.append(out_dir / "model.safetensors")
    written += write_hf_tokenizer(encoding, job.data.tokenizer, out_dir, cfg.block_size)
    return written


def output_problem(out: Path, force: bool) -> str | None:
    """Why the export may not write into `out`, or None when it may."""
    if out.exists() and not out.is_dir():
        return f"{out}: exists and is not a directory"
    if out.is_dir() and any(out.iterdir()) and not force:
        return f"{out}: directory is not empty; pass --force to write the export's files into it (other files are kept)"
    return None


def publish(staging: Path, out: Path) -> None:
    """Move the finished files of `staging` to `out`, then remove `staging`.

    A new `out` appears whole in one rename. Into an existing directory the files move one by one,
    each replaced atomically, and files the export did not write stay where they are.
    """
    if not out.exists():
        staging.rename(out)
        return
    for path in sorted(staging.iterdir()):
        os.replace(path, out / path.name)
    staging.rmdir()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lm.export",
        description="Export a checkpoint to another framework's format: --to hf writes a Hugging Face transformers "
                    "directory (GPT2LMHeadModel or LlamaForCausalLM, chosen from the model config).",
    )
    parser.add_argument("--checkpoint", required=True,
                        help="run directory, its checkpoints/ or one step_XXXXXXXX directory")
    parser.add_argument("--to", required=True, choices=["hf"], help="hf: a Hugging Face transformers directory")
    parser.add_argument("out", type=Path, metavar="OUT",
                        help="output directory (created; must be empty unless --force)")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty OUT: replace the files the export writes, keep the others")
    args = parser.parse_args(argv)
    problem = output_problem(args.out, args.force)
    if problem:
        parser.error(problem)

    if Path(args.checkpoint).suffix == ".safetensors":  # a consolidated file (python -m lm.consolidate)
        step_dir = Path(args.checkpoint)
        saved = read_consolidated_config(step_dir)
    else:
        step_dir = resolve_checkpoint(args.checkpoint)
        saved = read_config(step_dir)
    target = hf_target(saved.model)  # refuse before loading weights or creating anything
    model, job, _ = load_for_inference(step_dir, torch.device("cpu"))
    encoding = load_tokenizer(job.data.tokenizer)

    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    # A sibling on the same filesystem, so that publishing is a rename, and a failure never leaves a
    # half-written OUT behind.
    staging = out.parent / f".{out.name}.export-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        written = export_hf(model, job, encoding, staging)
        kept = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    names = {p.name for p in written}
    if others := [name for name in kept if name not in names]:
        log.warning("%s: kept files this export did not write: %s", out, ", ".join(others))
    log.info("exported %s (step dir %s) as %s to %s: %s", args.checkpoint, step_dir.name,
             TARGETS[target].hf_class, out, ", ".join(sorted(names)))
    return 0


if __name__ == "__main__":
    sys.exit(run(main))

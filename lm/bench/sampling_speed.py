"""Sampling throughput: our KV cache, no cache, compiled decoding over a static cache, and transformers' `generate`
on the exported model.

Every row decodes greedily from one end-of-text token per sequence for exactly `new_tokens` tokens, so
all rows do the same work; the share of tokens equal to ours shows that they run the same model. The compiled row
compiles in its warm-up call, whose time is not counted.
"""

import tempfile
from pathlib import Path

import torch

from lm.bench.common import median_seconds_interleaved
from lm.config import JobConfig
from lm.hf.export_files import export_hf
from lm.hf.targets import pick_target
from lm.models.generate import generate_batch
from lm.models.registry import family_of
from lm.tokenizer import load_tokenizer

COMPILED = "ours, static cache, compiled"
"""The compiled row's method"""


def exported_hf_model(model: torch.nn.Module, cfg: JobConfig, device: torch.device) -> torch.nn.Module:
    """`model` written by `lm.export --to hf` and read back by transformers (SDPA attention)."""
    from transformers import AutoModelForCausalLM

    target = pick_target(cfg.model, family_of(cfg.model).hf.targets, cfg.model.title)
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(model, target, load_tokenizer(cfg.data.tokenizer), cfg.data.tokenizer, Path(tmp))
        hf = AutoModelForCausalLM.from_pretrained(tmp, local_files_only=True, attn_implementation="sdpa",
                                                  trust_remote_code=bool(target.code))  # lm's own code runs trusted
    hf.generation_config.eos_token_id = None  # never stop early: every row makes all its tokens
    return hf.to(device).eval()


def bench_sampling(cfg: JobConfig, device: torch.device, batch: int, new_tokens: int, warmup: int,
                   reps: int, reps_no_cache: int, compiled: bool = False) -> list[dict]:
    """Rows {"method", "batch", "tokens/s", "ms/step", "same tokens"} for one batch size: ours with the KV cache,
    ours without, ours compiled (with `compiled`), then transformers'. A step decodes one token of every sequence
    of the batch, so ms/step is `batch` tokens' time."""
    torch.manual_seed(0)
    model = family_of(cfg.model).build(cfg.model).to(device).eval()
    eot = load_tokenizer(cfg.data.tokenizer).eot_token
    prompt = torch.full((batch, 1), eot, dtype=torch.long, device=device)  # (B, 1)
    hf = exported_hf_model(model, cfg, device)
    out: dict[str, torch.Tensor] = {}  # each method's tokens (B, new_tokens), by method name

    def ours(name: str, use_cache: bool, compiled: bool = False):
        def run() -> None:
            out[name] = generate_batch(model, prompt, new_tokens, temperature=0.0, use_cache=use_cache,
                                       compiled=compiled)
        return run

    def theirs() -> None:
        with torch.no_grad():
            tokens = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=new_tokens, pad_token_id=eot)
        out["transformers generate"] = tokens[:, 1:]

    methods = {"ours, KV cache": ours("ours, KV cache", True), "ours, no cache": ours("ours, no cache", False)}
    timed = {"ours, KV cache": reps, "ours, no cache": reps_no_cache}
    if compiled:
        methods[COMPILED] = ours(COMPILED, True, compiled=True)
        timed[COMPILED] = reps
    methods["transformers generate"], timed["transformers generate"] = theirs, reps
    # the compiled step compiles in its first call: warmed up at least once, whatever `warmup` says
    seconds = median_seconds_interleaved(methods, device, max(warmup, int(compiled)), timed)
    return [{"method": method, "batch": batch, "tokens/s": batch * new_tokens / s, "ms/step": s * 1e3 / new_tokens,
             "same tokens": (out[method] == out["ours, KV cache"]).float().mean().item()}
            for method, s in seconds.items()]

"""The trainer's periodic sample: the model in training continues one fixed prompt, the same way each time."""

import contextlib

import torch

from lm.config import JobConfig
from lm.distributed.engine import Engine
from lm.distributed.env import DistEnv
from lm.distributed.precision import autocast_for
from lm.inference.prompts import fill_masks, fit_prompt
from lm.models.generate import generate_batch
from lm.tokenizer import continuation_text, prompt_ids

TEMPERATURE = 0.8
TOP_K = 200


@torch.no_grad()
def sample_text(model: torch.nn.Module, cfg: JobConfig, tokenizer, device: torch.device) -> str:
    """log.sample_prompt continued by log.sample_tokens tokens (a GPT or LSTM), or its masks filled (encdec).

    Every rank must call it: a sharded model gathers its weights inside forward. The generator is seeded
    by train.seed, so all ranks draw the same tokens and take the same number of steps.
    """
    prompt = cfg.log.sample_prompt
    n = min(cfg.log.sample_tokens, cfg.model.block_size - 1)  # leave the prompt at least one position
    if cfg.model.arch == "encdec":
        return fill_masks(model, cfg.model, tokenizer, prompt, n, TEMPERATURE, TOP_K, None, cfg.train.seed)
    ids = fit_prompt(prompt_ids(tokenizer, prompt), n, cfg.model.block_size)
    idx = torch.tensor([ids], device=device)  # (1, T)
    generator = torch.Generator(device).manual_seed(cfg.train.seed)
    new = generate_batch(model, idx, n, temperature=TEMPERATURE, top_k=TOP_K, generator=generator)[0].tolist()
    if tokenizer.eot_token in new:  # a fixed-length batch runs past the end of the text; show up to it
        new = new[:new.index(tokenizer.eot_token)]
    return prompt + continuation_text(tokenizer, ids, new)


def periodic_sample(engine: Engine, cfg: JobConfig, tokenizer, env: DistEnv) -> str:
    """`sample_text` with the weights in training, on every rank.

    A GPT or LSTM samples through forward, where FSDP and ZeRO-3 gather each block as in training; an
    encoder-decoder's encode and decode bypass those hooks, so its whole weights are gathered first.
    autocast: a bf16 FSDP forward meets a cache of the weights' dtype. Eager: compiled blocks would
    compile again for every cache length.
    """
    gathered = engine.full_weights() if cfg.model.arch == "encdec" else contextlib.nullcontext()
    with gathered, autocast_for(cfg, env.device), torch.compiler.set_stance("force_eager"):
        return sample_text(engine.model, cfg, tokenizer, env.device)

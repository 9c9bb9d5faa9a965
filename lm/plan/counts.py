"""A model's sizes, read off the model its family builds on the meta device (nothing allocated, nothing drawn),
so they hold for every family, one a user adds too: its parameters, the units FSDP shards them into, its
training FLOPs per token and the bytes its activations take.

Parameters are the model's distinct ones (a tied head counted once). The count "without embeddings" of GPT-2's
papers leaves out the learned position tables (`lm.models.layers.PositionTable`) and keeps the token
embedding, which tied is also the output layer. The active ones are those one token goes through: all of them
but a mixture of experts' experts its router does not choose, which is what its FLOPs count. What counting cannot
see, the family's spec supplies (`Family.estimates`): which parameters a token leaves idle, the attention scores'
FLOPs, which no parameter stands for, and the activations a micro-batch saves for backward.
"""

import dataclasses
from dataclasses import dataclass

import torch.nn as nn

from lm.data.config import DataConfig
from lm.errors import ConfigError
from lm.models.config import ModelConfig
from lm.models.layers import PositionTable
from lm.models.registry import family_of


@dataclass(frozen=True)
class Counts:
    """The parameters of one model config, by where they sit."""

    total: int
    """Every distinct parameter"""
    positions: int
    """In learned position tables"""
    embeddings: int
    """In every embedding table (tokens, positions, token types)"""
    lookups: int
    """In the embedding tables that only a lookup reads, no matmul: all of them but a token embedding tied to the
    output layer"""
    unit: int
    """In the largest repeated unit (`Family.blocks`): what FSDP gathers as one"""
    root: int
    """Outside the repeated units (embeddings, final norms, head): FSDP's root unit"""
    idle: int
    """Not gone through by a token: a mixture of experts' unchosen experts (`Estimates.idle_params`)"""
    experts: int = 0
    """In the routed experts of every mixture-of-experts layer (`Parallel.experts`): what parallel.ep splits"""
    units: tuple[tuple[int, int], ...] = ()
    """The (parameters, of them in routed experts) of each kind of repeated unit, once, in model order"""
    expert_layers: int = 0
    """Modules of routed experts, one per mixture-of-experts layer"""
    n_experts: int = 0
    """Routed experts in each such module (the first dimension of their stacked weights)"""


_counted: dict[tuple[type, str], Counts] = {}
"""Counts by config (its class and its repr, which names every key): a planner asks for many layouts of one model."""


def counts(cfg: ModelConfig) -> Counts:
    """The parameters of the model `cfg` describes. A deep model is counted off shallow ones
    (`ModelConfig.depth_steps`): the config with its steps taken off, and it again with one of each step, which
    adds what every further such step adds; so a plan of any depth takes the time of a few blocks."""
    key = (type(cfg), repr(cfg))
    if key not in _counted:
        steps = [(keys, n) for keys, n in cfg.depth_steps() if n > 0]
        taken = {k: sum(n * keys.get(k, 0) for keys, n in steps) for keys, _ in steps for k in keys}
        shallow = dataclasses.replace(cfg, **{k: getattr(cfg, k) - n for k, n in taken.items()})
        base = _built(shallow, cfg)
        grown = [(_built(dataclasses.replace(shallow, **{k: getattr(shallow, k) + d for k, d in keys.items()}), cfg), n)
                 for keys, n in steps]
        built = [base, *(one for one, _ in grown)]
        more = {f: getattr(base, f) + sum(n * (getattr(one, f) - getattr(base, f)) for one, n in grown)
                for f in ("total", "positions", "embeddings", "lookups", "root", "experts", "expert_layers")}
        _counted[key] = dataclasses.replace(base, **more, unit=max(c.unit for c in built),
                                            units=tuple(dict.fromkeys(u for c in built for u in c.units)))
    return _counted[key]


def _built(cfg: ModelConfig, whole: ModelConfig) -> Counts:
    """The counts of the model `cfg` describes, built on the meta device; `whole` is the config counted, which
    says what a token leaves idle."""
    family = family_of(cfg)
    model = family.build_meta(cfg)
    sizes = {id(p): p.numel() for p in model.parameters()}
    tables = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    positions = {id(m.weight) for m in tables if isinstance(m, PositionTable)}
    in_tables = {id(p) for m in tables for p in m.parameters()}
    multiplied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}  # a tied head's is a table
    units = family.blocks(model)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    routed = family.parallel.experts(model) if family.parallel.experts else []
    in_experts = {id(p) for m in routed for p in m.parameters()}
    return Counts(
        total=sum(sizes.values()),
        positions=sum(sizes[i] for i in positions),
        embeddings=sum(sizes[i] for i in in_tables),
        lookups=sum(sizes[i] for i in in_tables - multiplied),
        unit=max(sum(p.numel() for p in unit.parameters()) for unit in units),
        root=sum(n for i, n in sizes.items() if i not in in_units),
        idle=0 if family.estimates.idle_params is None else family.estimates.idle_params(whole),
        experts=sum(sizes[i] for i in in_experts),
        units=tuple(dict.fromkeys((sum(p.numel() for p in unit.parameters()),
                                   sum(p.numel() for p in unit.parameters() if id(p) in in_experts))
                                  for unit in units)),
        expert_layers=len(routed),
        n_experts=next(iter(routed[0].parameters())).shape[0] if routed else 0,
    )


def num_params(cfg: ModelConfig, non_embedding: bool = False, active: bool = False) -> int:
    """Distinct parameters of the model (a tied head counted once); `non_embedding` leaves out position tables
    (they do no matmul), `active` the parameters a token does not go through (a mixture's unchosen experts)."""
    n = counts(cfg)
    return n.total - (n.positions if non_embedding else 0) - (n.idle if active else 0)


def params_outside_embeddings(cfg: ModelConfig) -> int:
    """Parameters outside every embedding table (tokens, positions, token types): what "non-embedding" means in
    scaling-law counts. A tied head is the token embedding, so it is left out; an untied one counts."""
    n = counts(cfg)
    return n.total - n.embeddings


def unit_params(cfg: ModelConfig, ep: int = 1) -> int:
    """Parameters of the largest repeated unit (what FSDP gathers as one); with `ep` expert-parallel ranks, a unit's
    routed experts count the 1/ep of them one rank gathers."""
    return max(params - experts + -(-experts // ep) for params, experts in counts(cfg).units)


def root_params(cfg: ModelConfig) -> int:
    """Parameters outside the repeated units (embeddings, final norms, head): FSDP's root unit."""
    return counts(cfg).root


def routed_per_token(cfg: ModelConfig) -> float:
    """Experts each token is sent to in a mixture-of-experts layer (top k), read off the counts: the experts a token
    goes through are the share (experts - idle) / experts of the n_experts in each layer. 0 without experts."""
    n = counts(cfg)
    return n.n_experts * (n.experts - n.idle) / n.experts if n.experts else 0.0


def flops_per_token(cfg: ModelConfig, seq_len: int, data: DataConfig) -> float:
    """Training FLOPs per token of windows of `seq_len` tokens: 6 per active parameter that a matmul reads (forward
    and backward; an embedding table that is only looked up does none, a token embedding tied to the head does),
    or the family's own estimate from that count (`Estimates.flops_per_token`)."""
    n = counts(cfg)
    params = n.total - n.lookups - n.idle
    estimate = family_of(cfg).estimates.flops_per_token
    return 6 * params if estimate is None else estimate(cfg, seq_len, data, params)


def activation_bytes(cfg: ModelConfig, data: DataConfig, micro_batch: int, act_bytes: int, residual_bytes: int,
                     every: int, fused_attention: bool) -> tuple[int, int]:
    """(activations, logits): the family's estimate of the bytes one device keeps for the backward of one
    micro-batch (`Estimates.activation_bytes`); ConfigError for a family that gives none."""
    family = family_of(cfg)
    estimate = family.estimates.activation_bytes
    if estimate is None:
        raise ConfigError(f"model.arch: {family.title} (model.arch={family.name}) gives no activation estimate")
    return estimate(cfg, data, micro_batch, act_bytes, residual_bytes, every, fused_attention)

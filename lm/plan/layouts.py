"""Which (tensor, pipeline, data)-parallel layout to train a config on: per-GPU memory and communication of every
layout a cluster of `nodes` x `gpus_per_node` can run, and a pick. Arithmetic on the config, like
`lm.plan.memory`, whose terms it reuses. `lm.plan.layout_table` prints it under `python -m lm.train --dry-run
--nodes N --gpus-per-node G`, and for the layout a config sets (context parallelism and HSDP included) under
`--dry-run` alone.

Memory per GPU, under the fsdp engine (the one that takes layouts), at the peak of a step, for the rank that needs
the most:
- model state: 16 bytes per parameter (fp32 weight and gradient, AdamW's two moments), of the parameters the rank
  holds: its stages' blocks and, with a pipeline, the embedding (first stage) or the head (last stage), each
  about half of the other parameters, all divided by tp (tensor parallelism splits every matrix; the norms it
  leaves whole are too small to count) and sharded by FSDP2 over the dp replicas (under HSDP over one replica's
  dp / dp_replicate ranks; with context parallelism over the cp ranks too);
- gathered: FSDP2's unsharded units, the root and two blocks, divided by tp, as a 16-bit weight and gradient;
- activations: what the family counts for the rank's blocks on one micro-batch (`Estimates.activation_bytes`),
  divided by tp (sequence parallelism splits all of them), times the micro-batches in flight on that rank
  (`in_flight`): 1 without a pipeline; pp - r on pipeline rank r under 1F1B (Narayanan et al. 2021); all the
  step's under GPipe; under interleaved 1F1B (v smaller stages per rank, each forward one stage's) the warm-up
  torch gives rank r, (v - 1) micro-batches of a round and 2 (pp - 1 - r) more, plus one. On the last stage, one
  micro-batch's logits / tp, and with tp > 1 the head's output slice, which torch's vocabulary-parallel
  cross-entropy keeps for backward; under GPipe what the loss keeps of each other micro-batch's too
  (`Estimates.kept_logits`). Under context parallelism (cp ranks, tp = pp = 1) the blocks keep what they
  keep for seq_len / cp tokens, but each block that keeps its activations holds the whole window's keys and values
  (`Estimates.context_kv` per token), and the head and the logits cover the whole window, gathered back.

A mixture of experts' routed experts (E parameters) are not divided by tp: every
tensor-parallel rank runs the mixture-of-experts sublayer whole. With expert parallelism (ep ranks taken from the dp
ranks, pp = 1) a rank holds n_experts / ep of each layer's experts, sharded by FSDP2 over the dp / ep ranks holding
the same ones: state 16 x ceil(ceil(E / ep) / (dp / ep)), and a gathered block holds 1/ep of its experts. (A stage's
other parameters count each of its blocks as the largest, its experts their share of E.)

Communication per GPU per optimizer step (bytes sent; the bus carries about as much again back):
- tp: per block and micro-batch, 2 all-gathers and 2 reduce-scatters of the b x s x h activations forward and
  the same backward, each moving (tp - 1) / tp of them;
- fsdp: per micro-batch an all-gather of the rank's 16-bit weights forward and again backward, and once per step a
  reduce-scatter of its fp32 gradients, each (dp - 1) / dp of them; under HSDP the shard is all-reduced over
  the replicas, 2 (r - 1) / r of it;
  (a rank's experts: an all-gather over the dp / ep ranks sharing them, (dp / ep - 1) / (dp / ep) of its ep rank's
  share);
- pp: per micro-batch and stage of the rank, the activations of its boundary forward and their gradient backward,
  / tp;
- ep: per mixture-of-experts layer and micro-batch, 4 x b x s x k x h x c x (ep - 1) / ep: each of the b x s tokens'
  hidden vectors (h x c bytes) goes to the ranks of its k experts and its output comes back (2 all-to-alls), and the
  backward sends their gradients the same two ways; with routing balanced a row stays on its own rank 1 time in ep;
- cp: per micro-batch, each block's all-gather of keys and values (again when recomputed) and one of the trunk's
  output, and backward's reduce-scatter of their gradients, each (cp - 1) / cp of the whole window's.

The pick is a rule of thumb, not a timing: of the layouts that fit, one that offloads nothing to host memory,
then one without recomputed activations (a third more compute), then with the fewest tensor-parallel ranks (a
collective in every sublayer, best inside one node's links), then the fewest pipeline stages (each adds idle
time at a step's start and end), then of the ep values the one that sends least (expert parallelism trades FSDP2's
all-gathers of the experts for two all-to-alls of the tokens in every mixture layer).
"""

import dataclasses
import math
from dataclasses import dataclass

from lm.config import JobConfig, device_type, use_bf16
from lm.config.rules import batch_split_problem
from lm.data.config import DataConfig
from lm.errors import ConfigError
from lm.models.config import ModelConfig
from lm.models.registry import family_of
from lm.models.sizes import ceil_div, checkpointed_blocks
from lm.plan.counts import activation_bytes, counts, root_params, routed_per_token
from lm.plan.memory import CUDA_CONTEXT_BYTES, GIB, check_ep

__all__ = ["LayoutEstimate", "RuledOut", "candidates", "estimate_layout", "fits_layout", "layout_rows", "most_gpus",
           "pick_layout"]


@dataclass(frozen=True)
class LayoutEstimate:
    tp: int
    pp: int
    dp: int
    activation_checkpointing: int
    micro_batches: int
    """per data-parallel replica and step"""
    state: int
    gathered: int
    activations: int
    """logits included"""
    tp_bytes: int
    fsdp_bytes: int
    pp_bytes: int
    cpu_offload: bool = False
    """FSDP2 keeps the model state in host memory (`state` is then the host's share per process)"""
    ep: int = 1
    """expert-parallel ranks, taken from the dp ranks"""
    ep_bytes: int = 0
    """sent by the all-to-alls of the mixture-of-experts layers"""
    cp: int = 1
    """context-parallel ranks per replica, each holding 1/cp of every window's tokens"""
    dp_replicate: int = 1
    """HSDP: the dp ranks as this many replicas, each sharding the model over dp / dp_replicate (x cp) ranks"""
    cp_bytes: int = 0
    """sent by the context-parallel all-gathers of keys, values and the trunk's output, and their backward"""

    @property
    def total(self) -> int:
        """Bytes on the GPU."""
        return (0 if self.cpu_offload else self.state) + self.gathered + self.activations

    @property
    def label(self) -> str:
        hsdp = f" (hsdp {self.dp_replicate} x {self.dp // self.dp_replicate})" if self.dp_replicate > 1 else ""
        return (f"tp {self.tp} x pp {self.pp}" + (f" x cp {self.cp}" if self.cp > 1 else "") + f" x dp {self.dp}"
                + hsdp + (f" (ep {self.ep})" if self.ep > 1 else ""))


def stage_sizes(n_layer: int, stages: int) -> list[int]:
    """The blocks of each of `stages` pipeline stages (`lm.distributed.pipeline.stage_layers` builds them): n_layer
    // stages each, the rest one more each for the middle stages first, then the last, then the first (which also
    embeds)."""
    sizes = [n_layer // stages] * stages
    for s in [*range(1, stages - 1), stages - 1, 0][:n_layer % stages]:
        sizes[s] += 1
    return sizes


def in_flight(schedule: str, pp: int, rank: int, n_micro: int, stages_per_rank: int = 1) -> int:
    """The most forwards of one stage that pipeline rank `rank` of `pp` holds for backward at once, under torch's
    `schedule` of `n_micro` micro-batches: all of them under gpipe, pp - rank under 1f1b (its warm-up forwards and
    the one before its first backward), and under interleaved_1f1b, whose ranks each hold `stages_per_rank`
    smaller stages, the warm-up torch gives that rank (`_get_warmup_ops`: the other stages' share of a round,
    2 more a rank away from the last) and one more."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return n_micro
    if schedule == "1f1b":
        return min(n_micro, pp - rank)
    per_round = n_micro // max(1, n_micro // pp)
    warmup = (stages_per_rank - 1) * per_round + 2 * (pp - 1 - rank)
    return min(warmup + 1, n_micro * stages_per_rank)


def estimate_layout(cfg: JobConfig, tp: int, pp: int, dp: int, activation_checkpointing: int,
                    cpu_offload: bool = False, ep: int = 1, cp: int = 1, dp_replicate: int = 1,
                    schedule: str = "1f1b", stages_per_rank: int = 1) -> LayoutEstimate:
    """Per-GPU memory and communication of training `cfg` (fsdp) on the layout tp x pp x cp x dp, the pipeline's
    `schedule` running `stages_per_rank` stages on each of its ranks, with `ep` of a replica's dp ranks splitting
    a mixture's experts and the dp ranks as `dp_replicate` HSDP replicas; with `cpu_offload` the model state lives
    in host memory."""
    model = cfg.model
    dp_shard = dp // dp_replicate  # one replica's data-parallel ranks: FSDP2 shards over them (and the cp ranks)
    check_ep(cfg, ep, dp_shard)
    if ep > 1 and pp > 1:
        raise ConfigError(f"parallel.ep={ep}: expert parallelism does not combine with parallel.pp={pp}; expected pp=1")
    n = counts(model)
    # routed experts: whole on every tensor-parallel rank, split over ep ranks, then sharded over dp / ep; a stage
    # counts each of its blocks as the largest one's other parameters
    dense_unit = max(params - experts for params, experts in n.units)
    # the largest unit as a rank gathers it: its other parameters / tp, its experts / ep
    gathered_unit = max(int((params - experts) / tp) + ceil_div(experts, ep) for params, experts in n.units)
    mixed = use_bf16(cfg.train.dtype, device_type(cfg.train.device))
    c = 2 if mixed else 4
    b, s, h = cfg.train.micro_batch_size, cfg.data.seq_len, model.d_model
    n_micro = cfg.train.batch_size // (b * dp)
    root = root_params(model)
    estimates = family_of(model).estimates
    ranks = []
    stages = stage_sizes(model.n_layer, pp * stages_per_rank)  # rank r runs stages r, r + pp, r + 2 pp, ...
    for rank in range(pp):
        own = stages[rank::pp]
        layers, first, last = sum(own), rank == 0, rank == pp - 1
        own_root = root if pp == 1 else root // 2 * (first + last)
        params = (layers * dense_unit + own_root) / tp
        # this ep rank's share of its blocks' experts (the blocks' share of them all: some blocks may be dense)
        experts = ceil_div(n.experts * layers, model.n_layer * ep)
        state = 16 * (ceil_div(int(params), dp_shard * cp) + ceil_div(experts, dp_shard // ep))
        gathered = (int(own_root / tp) + 2 * gathered_unit) * (2 * c)
        stage = dataclasses.replace(model, n_layer=max(own))  # a forward in flight: of the rank's largest stage
        acts, logits = activation_bytes(stage, cfg.data, b, c, c, activation_checkpointing, True)
        if cp > 1:
            acts, logits = _context_activations(stage, cfg.data, b, c, activation_checkpointing, cp)
        # torch's vocabulary-parallel cross-entropy also keeps its input, the head's output (its slice after / tp)
        kept_input = b * s * model.padded_vocab_size * c if tp > 1 else 0
        acts = (acts - logits) * in_flight(schedule, pp, rank, n_micro, stages_per_rank) + \
            (logits + kept_input if last else 0)
        if last and schedule == "gpipe" and pp > 1:  # the other micro-batches' losses await their backward too
            kept = logits if estimates.kept_logits is None else estimates.kept_logits(model, cfg.data, b)
            acts += (kept + kept_input) * (n_micro - 1)
        ranks.append((state + gathered + acts // tp, state, gathered, acts // tp))
    _, state, gathered, acts = max(ranks)
    boundary = b * s * h * c
    most = max(sum(stages[rank::pp]) for rank in range(pp))
    tp_bytes = 8 * boundary * (tp - 1) // tp * most * n_micro if tp > 1 else 0
    local = (most * dense_unit + (root if pp == 1 else root // 2)) / tp
    fsdp_bytes = _fsdp_bytes(local, n_micro, dp_shard * cp, dp_replicate)
    # the ranks FSDP2 shards one ep rank's experts over
    fsdp_bytes += _fsdp_bytes(n.experts * most / model.n_layer / ep, n_micro, dp_shard // ep, dp_replicate)
    pp_bytes = 2 * boundary // tp * n_micro * stages_per_rank if pp > 1 else 0  # a boundary after each stage
    # the experts of the largest stage's mixture layers (pp is 1 under ep: all of them)
    ep_bytes = int(4 * b * s * routed_per_token(model) * h * c * (ep - 1) / ep) * n.expert_layers * n_micro
    cp_bytes = _context_bytes(model, b * s, c, activation_checkpointing, cp) * n_micro
    return LayoutEstimate(tp, pp, dp, activation_checkpointing, n_micro, state, gathered, acts, tp_bytes,
                          fsdp_bytes, pp_bytes, cpu_offload, ep, ep_bytes, cp, dp_replicate, cp_bytes)


def _fsdp_bytes(params: float, n_micro: int, shard: int, replicas: int) -> int:
    """What FSDP2 sends per step for `params` parameters sharded over `shard` ranks: each micro-batch all-gathers
    the 16-bit weights forward and again backward, the step reduce-scatters the fp32 gradients, and under HSDP
    all-reduces each shard's gradients over the `replicas` (sending twice (r - 1) / r of them)."""
    sent = params * (4 * n_micro + 4) * (shard - 1) / shard
    return int(sent + 8 * params / shard * (replicas - 1) / replicas)


def _context_kv(model: ModelConfig) -> int:
    """The key and value elements per token each block gathers under context parallelism (the family's)."""
    kv = family_of(model).estimates.context_kv
    if kv is None:
        raise ConfigError(f"parallel.cp: the planner has no context-parallel estimate for {model.title} "
                          f"(model.arch={model.arch})")
    return kv(model)


def _context_activations(model: ModelConfig, data: DataConfig, b: int, c: int, every: int, cp: int
                         ) -> tuple[int, int]:
    """(activations, logits) of one of `cp` context-parallel ranks (`lm.distributed.context_parallel`): its blocks
    keep what they keep for seq_len / cp tokens of each window, but each block that keeps its activations holds
    the whole window's keys and values in place of its own share's, and the trunk's output is gathered back to
    the whole window, which the head reads and whose logits every rank of the group computes."""
    s, h = data.seq_len, model.d_model
    acts, share_logits = activation_bytes(model, dataclasses.replace(data, seq_len=s // cp), b, c, c, every, True)
    logits = activation_bytes(model, data, b, c, c, every, True)[1]
    k = checkpointed_blocks(model.n_layer, every)
    keeping = model.n_layer - k + (1 if k else 0)  # with recomputation, one block's at a time
    others = b * (s - s // cp)  # the tokens of the other ranks
    return acts - share_logits + logits + c * others * (keeping * _context_kv(model) + h), logits


def _context_bytes(model: ModelConfig, tokens: int, c: int, every: int, cp: int) -> int:
    """Sent per micro-batch of `tokens` by one of `cp` context-parallel ranks: every block's forward all-gathers
    the keys and values (again when it is recomputed), the trunk's output is all-gathered once, and backward
    reduce-scatters the gradients of each; a rank sends (cp - 1) / cp of a gathered tensor."""
    if cp == 1:
        return 0
    k = checkpointed_blocks(model.n_layer, every)
    gathered = (2 * model.n_layer + k) * _context_kv(model) + 2 * model.d_model
    return int(c * tokens * gathered * (cp - 1) / cp)


def _divisors(n: int) -> list[int]:
    """In order; by pairs up to sqrt(n), so that a planned world of millions of GPUs is quick."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


@dataclass(frozen=True)
class RuledOut:
    """A (tp, pp) of the cluster that no layout takes, and the constraint that rules it out."""

    tp: int
    pp: int
    dp: int
    constraint: str
    """"divisibility" (the model does not split over tp or pp) or "batch split" (the global batch does not split
    over dp replicas, or gives a pipeline fewer micro-batches than stages)"""
    reason: str


def _ruled_out(cfg: JobConfig, tp: int, pp: int, dp: int) -> RuledOut | None:
    """Why the layout tp x pp x dp cannot train `cfg`, whatever the memory; None when it can."""
    model, train, parallel = cfg.model, cfg.train, family_of(cfg.model).parallel
    if tp > 1 and (problem := parallel.tensor_problem(model, tp)):
        return RuledOut(tp, pp, dp, "divisibility", f"parallel.tp={tp}: {problem}")
    if tp > 1 and cfg.data.seq_len % tp:
        return RuledOut(tp, pp, dp, "divisibility", f"parallel.tp={tp}: data.seq_len {cfg.data.seq_len} does not "
                        "split over the tensor-parallel ranks (sequence parallelism)")
    if pp > 1 and (problem := parallel.pipeline_problem(model, pp)):
        return RuledOut(tp, pp, dp, "divisibility", f"parallel.pp={pp}: {problem}")
    of = f"world size {tp * pp * dp} / (tp {tp} x pp {pp})" if tp * pp > 1 else f"world size {dp}"
    if problem := batch_split_problem(train.batch_size, train.micro_batch_size, dp, of):
        return RuledOut(tp, pp, dp, "batch split", problem)
    if train.batch_size // (train.micro_batch_size * dp) < pp:
        return RuledOut(tp, pp, dp, "batch split", f"parallel.pp={pp}: 1F1B needs at least one micro-batch per "
                        f"pipeline rank, and a step has {train.batch_size // (train.micro_batch_size * dp)} per "
                        f"replica over {dp} replicas")
    return None


def candidates(cfg: JobConfig, nodes: int, gpus_per_node: int) -> tuple[list[tuple[int, int, int]], list[RuledOut]]:
    """The (tp, pp, dp) of nodes x gpus_per_node that can train `cfg` (tp within a node), and those that cannot,
    each with the constraint that rules it out."""
    world = nodes * gpus_per_node
    fit, out = [], []
    for tp in _divisors(gpus_per_node):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            if (why := _ruled_out(cfg, tp, pp, dp)) is None:
                fit.append((tp, pp, dp))
            else:
                out.append(why)
    return fit, out


def layout_rows(cfg: JobConfig, nodes: int, gpus_per_node: int) -> list[LayoutEstimate]:
    """Every layout of nodes x gpus_per_node the config can take, without and with activation checkpointing: tp
    within a node, dividing what the model splits; pp what the model cuts into stages; dp the rest, with the
    global batch a whole number of micro-batches per replica and at least one per pipeline rank; for a mixture of
    experts without a pipeline, every ep dividing both its n_experts and dp. Last, FSDP2 alone with its state
    offloaded to host memory (parallel.cpu_offload), every block recomputed."""
    model, parallel = cfg.model, family_of(cfg.model).parallel
    rows = []
    for tp, pp, dp in candidates(cfg, nodes, gpus_per_node)[0]:
        eps = [1] if pp > 1 or not parallel.experts else \
            [ep for ep in _divisors(dp) if ep == 1 or not parallel.expert_problem(model, ep)]
        rows += [estimate_layout(cfg, tp, pp, dp, every, ep=ep) for ep in eps for every in (0, 1)]
    if rows and rows[0].tp == rows[0].pp == 1:
        rows.append(estimate_layout(cfg, 1, 1, rows[0].dp, 1, cpu_offload=True))
    return rows


def most_gpus(cfg: JobConfig, gpus_per_node: int) -> tuple[int, int, int]:
    """The (tp, pp, dp) with the most GPUs that the model and the global batch allow (tp within a node of
    gpus_per_node, pp up to the model's layers), whatever the cluster."""
    micro = cfg.train.batch_size // cfg.train.micro_batch_size  # a pipeline stage takes one micro-batch at least
    layouts = [(tp, pp, dp) for tp in _divisors(gpus_per_node) for pp in range(1, min(cfg.model.n_layer, micro) + 1)
               for dp in _divisors(micro) if _ruled_out(cfg, tp, pp, dp) is None]
    return max(layouts, key=lambda layout: (layout[0] * layout[1] * layout[2], -layout[0]))


def fits_layout(row: LayoutEstimate, device_gib: float) -> bool:
    """As `lm.plan.memory_table.fits`: the estimate plus 10% and the CUDA context within the device."""
    return row.total * 1.1 + CUDA_CONTEXT_BYTES <= device_gib * GIB


def pick_layout(rows: list[LayoutEstimate], device_gib: float) -> LayoutEstimate | None:
    """The rule of thumb of the module docstring; None when nothing fits."""
    fitting = [row for row in rows if fits_layout(row, device_gib)]
    return min(fitting, key=lambda r: (r.cpu_offload, r.activation_checkpointing > 0, r.tp, r.pp,
                                       r.fsdp_bytes + r.ep_bytes), default=None)

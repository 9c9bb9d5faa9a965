"""Which (tensor, pipeline, data)-parallel layout to train a config on: per-GPU memory and communication of every
layout a cluster of `nodes` x `gpus_per_node` can run, and a pick. Arithmetic on the config, like
`lm.plan.memory`, whose terms it reuses; it prints under `python -m lm.train --dry-run --nodes N --gpus-per-node G`.

Memory per GPU, under the fsdp engine (the one that takes layouts), at the peak of a step, for the rank that needs
the most:
- model state: 16 bytes per parameter (fp32 weight and gradient, AdamW's two moments), of the parameters the rank
  holds: its stages' blocks and, with a pipeline, the embedding (first stage) or the head (last stage), each
  about half of the other parameters, all divided by tp (tensor parallelism splits every matrix; the norms it
  leaves whole are too small to count) and sharded by FSDP2 over the dp replicas;
- gathered: FSDP2's unsharded units, the root and two blocks, divided by tp, as a 16-bit weight and gradient;
- activations: what the family counts for the rank's blocks on one micro-batch (`Estimates.activation_bytes`),
  divided by tp (sequence parallelism splits all of them), times the micro-batches in flight on that rank: 1
  without a pipeline, pp - r on pipeline rank r under 1F1B (Narayanan et al. 2021); plus one micro-batch's
  logits / tp on the last stage, with tp > 1 also the head's output slice, which torch's vocabulary-parallel
  cross-entropy keeps for backward.

A mixture of experts' routed experts (E parameters) are not divided by tp: every
tensor-parallel rank runs the mixture-of-experts sublayer whole. With expert parallelism (ep ranks taken from the dp
ranks, pp = 1) a rank holds n_experts / ep of each layer's experts, sharded by FSDP2 over the dp / ep ranks holding
the same ones: state 16 x ceil(ceil(E / ep) / (dp / ep)), and a gathered block holds 1/ep of its experts. (A stage's
other parameters count each of its blocks as the largest, its experts their share of E.)

Communication per GPU per optimizer step (bytes sent; the bus carries about as much again back):
- tp: per block and micro-batch, 2 all-gathers and 2 reduce-scatters of the b x s x h activations forward and
  the same backward, each moving (tp - 1) / tp of them;
- fsdp: per micro-batch an all-gather of the rank's 16-bit weights forward and again backward, and once per step a
  reduce-scatter of its fp32 gradients, each (dp - 1) / dp of them;
  (a rank's experts: an all-gather over the dp / ep ranks sharing them, (dp / ep - 1) / (dp / ep) of its ep rank's
  share);
- pp: per micro-batch, the activations of one stage boundary forward and their gradient backward, / tp;
- ep: per mixture-of-experts layer and micro-batch, 4 x b x s x k x h x c x (ep - 1) / ep: each of the b x s tokens'
  hidden vectors (h x c bytes) goes to the ranks of its k experts and its output comes back (2 all-to-alls), and the
  backward sends their gradients the same two ways; with routing balanced a row stays on its own rank 1 time in ep.

The pick is a rule of thumb, not a timing: of the layouts that fit, one that offloads nothing to host memory,
then one without recomputed activations (a third more compute), then with the fewest tensor-parallel ranks (a
collective in every sublayer, best inside one node's links), then the fewest pipeline stages (each adds idle
time at a step's start and end), then of the ep values the one that sends least (expert parallelism trades FSDP2's
all-gathers of the experts for two all-to-alls of the tokens in every mixture layer).
"""

import dataclasses
from dataclasses import dataclass

from lm.config import JobConfig, device_type, use_bf16
from lm.errors import ConfigError
from lm.models.registry import family_of
from lm.models.sizes import ceil_div
from lm.plan.counts import activation_bytes, counts, root_params, routed_per_token
from lm.plan.memory import CUDA_CONTEXT_BYTES, GIB, check_ep

__all__ = ["LayoutEstimate", "estimate_layout", "layout_rows", "layout_table", "pick_layout"]


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

    @property
    def total(self) -> int:
        """Bytes on the GPU."""
        return (0 if self.cpu_offload else self.state) + self.gathered + self.activations

    @property
    def label(self) -> str:
        return f"tp {self.tp} x pp {self.pp} x dp {self.dp}" + (f" (ep {self.ep})" if self.ep > 1 else "")


def _stage_layers(n_layer: int, pp: int) -> list[int]:
    """Blocks per pipeline rank, as `lm.distributed.pipeline.stage_layers` splits them (its favoured order)."""
    sizes = [n_layer // pp] * pp
    for s in [*range(1, pp - 1), pp - 1, 0][:n_layer % pp]:
        sizes[s] += 1
    return sizes


def estimate_layout(cfg: JobConfig, tp: int, pp: int, dp: int, activation_checkpointing: int,
                    cpu_offload: bool = False, ep: int = 1) -> LayoutEstimate:
    """Per-GPU memory and communication of training `cfg` (fsdp, 1F1B when pp > 1) on the layout tp x pp x dp,
    with `ep` of the dp ranks splitting a mixture's experts; with `cpu_offload` the model state lives in host
    memory."""
    model = cfg.model
    check_ep(cfg, ep, dp)
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
    ranks = []
    for rank, layers in enumerate(_stage_layers(model.n_layer, pp)):
        first, last = rank == 0, rank == pp - 1
        own_root = root if pp == 1 else root // 2 * (first + last)
        params = (layers * dense_unit + own_root) / tp
        # this ep rank's share of its blocks' experts (the blocks' share of them all: some blocks may be dense)
        experts = ceil_div(n.experts * layers, model.n_layer * ep)
        state = 16 * (ceil_div(int(params), dp) + ceil_div(experts, dp // ep))
        gathered = (int(own_root / tp) + 2 * gathered_unit) * (2 * c)
        acts, logits = activation_bytes(dataclasses.replace(model, n_layer=layers), cfg.data, b, c, c,
                                        activation_checkpointing, True)
        in_flight = 1 if pp == 1 else min(n_micro, pp - rank)  # 1F1B: stage r holds pp - r forwards at most
        # torch's vocabulary-parallel cross-entropy also keeps its input, the head's output (its slice after / tp)
        kept_input = b * s * model.padded_vocab_size * c if tp > 1 else 0
        acts = (acts - logits) * in_flight + (logits + kept_input if last else 0)
        ranks.append((state + gathered + acts // tp, state, gathered, acts // tp))
    _, state, gathered, acts = max(ranks)
    boundary = b * s * h * c
    tp_bytes = 8 * boundary * (tp - 1) // tp * max(_stage_layers(model.n_layer, pp)) * n_micro if tp > 1 else 0
    most = max(_stage_layers(model.n_layer, pp))
    local = (most * dense_unit + (root if pp == 1 else root // 2)) / tp
    fsdp_bytes = int(local * (4 * n_micro + 4) * (dp - 1) / dp) if dp > 1 else 0
    sharing = dp // ep  # the ranks FSDP2 shards one ep rank's experts over
    if sharing > 1:
        fsdp_bytes += int(n.experts * most / model.n_layer / ep * (4 * n_micro + 4) * (sharing - 1) / sharing)
    pp_bytes = 2 * boundary // tp * n_micro if pp > 1 else 0
    # the experts of the largest stage's mixture layers (pp is 1 under ep: all of them)
    ep_bytes = int(4 * b * s * routed_per_token(model) * h * c * (ep - 1) / ep) * n.expert_layers * n_micro
    return LayoutEstimate(tp, pp, dp, activation_checkpointing, n_micro, state, gathered, acts, tp_bytes,
                          fsdp_bytes, pp_bytes, cpu_offload, ep, ep_bytes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_rows(cfg: JobConfig, nodes: int, gpus_per_node: int) -> list[LayoutEstimate]:
    """Every layout of nodes x gpus_per_node the config can take, without and with activation checkpointing: tp
    within a node, dividing what the model splits; pp what the model cuts into stages; dp the rest, with the
    global batch a whole number of micro-batches per replica and at least one per pipeline rank; for a mixture of
    experts without a pipeline, every ep dividing both its n_experts and dp. Last, FSDP2 alone with its state
    offloaded to host memory (parallel.cpu_offload), every block recomputed."""
    world = nodes * gpus_per_node
    model, train, parallel = cfg.model, cfg.train, family_of(cfg.model).parallel
    rows = []
    for tp in _divisors(gpus_per_node):
        if tp > 1 and (parallel.tensor_problem(model, tp) or cfg.data.seq_len % tp):
            continue
        for pp in _divisors(world // tp):
            if pp > 1 and parallel.pipeline_problem(model, pp):
                continue
            dp = world // (tp * pp)
            per_replica = train.micro_batch_size * dp
            if train.batch_size % per_replica or train.batch_size // per_replica < pp:
                continue
            eps = [1] if pp > 1 or not parallel.experts else \
                [ep for ep in _divisors(dp) if ep == 1 or not parallel.expert_problem(model, ep)]
            rows += [estimate_layout(cfg, tp, pp, dp, every, ep=ep) for ep in eps for every in (0, 1)]
    if rows and rows[0].tp == rows[0].pp == 1:
        rows.append(estimate_layout(cfg, 1, 1, rows[0].dp, 1, cpu_offload=True))
    return rows


def fits_layout(row: LayoutEstimate, device_gib: float) -> bool:
    """As `lm.plan.memory_table.fits`: the estimate plus 10% and the CUDA context within the device."""
    return row.total * 1.1 + CUDA_CONTEXT_BYTES <= device_gib * GIB


def pick_layout(rows: list[LayoutEstimate], device_gib: float) -> LayoutEstimate | None:
    """The rule of thumb of the module docstring; None when nothing fits."""
    fitting = [row for row in rows if fits_layout(row, device_gib)]
    return min(fitting, key=lambda r: (r.cpu_offload, r.activation_checkpointing > 0, r.tp, r.pp,
                                       r.fsdp_bytes + r.ep_bytes), default=None)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f}"


def layout_table(cfg: JobConfig, nodes: int, gpus_per_node: int, device_gib: float) -> str:
    """The layouts of `layout_rows` as a text table, and the pick with its reasons."""
    rows = layout_rows(cfg, nodes, gpus_per_node)
    world = nodes * gpus_per_node
    head = (f"{'layout':<30} {'ckpt':>4} {'offload':>7} {'micro':>5} {'state':>7} {'gather':>7} {'activ':>7} "
            f"{'GPU GiB':>8} {'tp GB':>7} {'fsdp GB':>7} {'pp GB':>6} {'ep GB':>6}  fits {device_gib:g} GiB")
    lines = [f"layouts on {nodes} node(s) x {gpus_per_node} GPUs = {world} (fsdp engine, 1F1B): per-GPU memory in "
             f"GiB and data sent per GPU per step in GB", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.label:<30} {r.activation_checkpointing:>4} {'yes' if r.cpu_offload else 'no':>7} "
                     f"{r.micro_batches:>5} {_gib(r.state):>7} "
                     f"{_gib(r.gathered):>7} {_gib(r.activations):>7} {_gib(r.total):>8} {_gb(r.tp_bytes):>7} "
                     f"{_gb(r.fsdp_bytes):>7} {_gb(r.pp_bytes):>6} {_gb(r.ep_bytes):>6}  "
                     f"{'yes' if fits_layout(r, device_gib) else 'no'}")
    lines.append("micro: micro-batches per replica and step. state: weights, gradients and AdamW moments (in host "
                 "memory when offloaded); gather: FSDP2's unsharded units; activ: activations and logits; all for "
                 "the rank that needs most")
    best = pick_layout(rows, device_gib)
    if best is None:
        lines.append(f"pick: no layout fits {device_gib:g} GiB at train.micro_batch_size="
                     f"{cfg.train.micro_batch_size}; lower it, or add GPUs")
        return "\n".join(lines)
    every = best.activation_checkpointing
    keys = [f"--parallel.tp={best.tp}"] * (best.tp > 1) + [f"--parallel.pp={best.pp}"] * (best.pp > 1) + \
        [f"--parallel.activation_checkpointing={every}"] * (every > 0) + \
        ["--parallel.cpu_offload=true"] * best.cpu_offload + [f"--parallel.ep={best.ep}"] * (best.ep > 1)
    recompute = "every block" if best.activation_checkpointing else "off"
    host = f", {_gib(best.state)} GiB host memory per process" if best.cpu_offload else ""
    lines.append(f"pick: {best.label}, activation checkpointing {recompute} ({_gib(best.total)} GiB per GPU{host}): "
                 f"{' '.join(['--parallel.engine=fsdp', *keys])}")
    lines.append("why: of the layouts that fit, it offloads nothing if any can (host transfers are slowest), "
                 "recomputes nothing if any can (recomputing costs a third more compute), then has the fewest "
                 "tensor-parallel ranks (a collective in every sublayer), then the fewest pipeline stages (idle "
                 "time at each step's start and end)" + (", then of the expert-parallel ranks the number that "
                 "sends least (FSDP2's all-gathers of the experts against the all-to-alls of the tokens)"
                 if any(r.ep > 1 for r in rows) else ""))
    return "\n".join(lines)

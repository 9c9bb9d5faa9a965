"""A mixture-of-experts feed-forward sublayer: a router sends each token to `experts_per_token` of `n_experts`
feed-forward networks, whose outputs it sums weighted by the router; shared experts, when there are any, see
every token.

Dropless: every token reaches its top-k experts (no capacity, nothing dropped). The (token, expert) pairs are
sorted by expert, so each expert's tokens are one contiguous slice, and all experts run as one grouped matrix
product (`torch._grouped_mm`) where the device and dtype allow it, or one matrix product per expert otherwise;
both compute the same numbers.

The router also measures its balance for the loss (`RouterStats`): the load-balancing loss of the Switch
Transformer (Fedus et al. 2021), n_experts * sum_e f_e p_e, with f_e the share of the routed pairs that went to
expert e and p_e the router's mean probability for e (1 when the load is even), and the router z-loss of
ST-MoE (Zoph et al. 2022), the mean squared log-sum-exp of the router logits. The family turns them into named
loss terms (`with_router_terms`, `lm.models.gpt.family`).

Auxiliary-loss-free balancing (DeepSeek-V3; Wang et al. 2024, model.router_bias_rate): a per-expert bias added to
the router's scores chooses the top k, while the chosen experts' weights stay the unbiased scores, so the bias
steers the load and no gradient. After each optimizer step `balance_routers` raises the bias of the experts that
received fewer tokens than the mean over that whole step and lowers the others': by the rate (DeepSeek-V3's sign
rule) or by the rate times the relative imbalance (the error rule), either scaled by the learning-rate schedule.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from lm.models.gpt.config import GPTConfig
from lm.models.layers import MLP, activate
from lm.models.terms import Losses, Reduce, Term


@dataclass(frozen=True)
class RouterStats:
    """What one forward of a mixture-of-experts layer measured of its routing."""

    layer: int
    """The block it belongs to (from 0)"""
    balance: torch.Tensor
    """0-dim: the load-balancing loss, n_experts * sum_e f_e p_e"""
    z_loss: torch.Tensor
    """0-dim: the mean squared log-sum-exp of the router logits"""
    counts: torch.Tensor
    """(n_experts,) the tokens each expert received"""

    @property
    def load(self) -> torch.Tensor:
        """0-dim: the most loaded expert's tokens over the mean (1: even)."""
        counts = self.counts.float()
        return counts.max() / counts.mean()


class Router(nn.Module):
    """Scores each token against every expert and picks its top k (model.router); with model.router_bias_rate, by
    the scores plus a balancing bias (`balance_routers`)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.kind, self.k, self.renorm = cfg.router, cfg.experts_per_token, cfg.router_renorm
        self.gate = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.bias_rate, self.bias_update = cfg.router_bias_rate, cfg.router_bias_update
        if self.bias_rate:
            # DeepSeek-V3's e_score_correction_bias: a buffer (no gradient, no optimizer), saved with the weights
            self.register_buffer("score_bias", torch.zeros(cfg.n_experts))
        self.routed: torch.Tensor | None = None
        """(E,) int64: the (token, choice) pairs each expert received in training forwards since the last bias
        update; not a buffer, which DDP would overwrite with rank 0's at every forward"""

    def reset_bias(self) -> None:
        """Zero the balancing bias, if there is one (the model's init, on the meta device's `to_empty` too)."""
        if self.bias_rate:
            with torch.no_grad():
                self.score_bias.zero_()
        self.routed = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, C) -> the top-k weights (N, k) float32, the chosen experts (N, k), the logits (N, E) float32 and
        each token's probabilities over the experts (N, E), which the balance loss averages."""
        logits = self.gate(x).float()  # routing decisions in float32, as Mixtral's and DeepSeek's
        if self.kind == "sigmoid":
            scores = logits.sigmoid()
            weights, chosen = self.top_k(scores)
            return weights / weights.sum(-1, keepdim=True), chosen, logits, scores / scores.sum(-1, keepdim=True)
        probs = logits.softmax(-1)
        weights, chosen = self.top_k(probs)
        if self.renorm:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, chosen, logits, probs

    def top_k(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """scores (N, E) -> the k chosen experts' scores (N, k) and the experts (N, k); with a balancing bias the
        experts are those of the top k of scores + bias, and a training forward counts them into `routed`."""
        if not self.bias_rate:
            return scores.topk(self.k, dim=-1)
        chosen = (scores + self.score_bias).topk(self.k, dim=-1).indices  # (N, k)
        if self.training:
            # a checkpointed block's recomputation in backward counts its tokens again: every expert's count of
            # that layer doubles, which leaves sign(mean - load), all the update reads, as it was
            pairs = chosen.reshape(-1)
            counts = torch.zeros(scores.shape[-1], dtype=torch.long, device=pairs.device).index_add_(
                0, pairs, torch.ones_like(pairs))
            self.routed = counts if self.routed is None else self.routed + counts
        return scores.gather(-1, chosen), chosen


class Experts(nn.Module):
    """`n` feed-forward networks of model.mlp's kind with `hidden` units each, their weights stacked:
    w_in (n, C, hidden), for swiglu w_gate alike, and w_out (n, hidden, C)."""

    def __init__(self, cfg: GPTConfig, n: int, hidden: int) -> None:
        super().__init__()
        self.kind = cfg.mlp
        self.w_in = nn.Parameter(torch.empty(n, cfg.d_model, hidden))
        if cfg.mlp == "swiglu":
            self.w_gate = nn.Parameter(torch.empty(n, cfg.d_model, hidden))
        self.w_out = nn.Parameter(torch.empty(n, hidden, cfg.d_model))
        self.grouped: bool | None = None
        """None: one grouped product where `grouped_mm_fits`, else one product per expert; True or False forces it"""

    def draw_(self, std: float, out_std: float) -> None:
        """Draw the weights from the global RNG: inputs ~ N(0, std), outputs ~ N(0, out_std) (they write into the
        residual stream)."""
        nn.init.normal_(self.w_in, std=std)
        if hasattr(self, "w_gate"):
            nn.init.normal_(self.w_gate, std=std)
        nn.init.normal_(self.w_out, std=out_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, C): rows sorted by expert, `counts` (n,) of them for each -> (N, C), each row through its expert."""
        grouped = grouped_mm_fits(x, self.w_in, self.w_out) if self.grouped is None else self.grouped
        if not grouped:
            return per_expert(self.kind, x, counts, self.w_in, getattr(self, "w_gate", None), self.w_out)
        ends = counts.cumsum(0).to(torch.int32)

        def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(a, w.to(a.dtype), offs=ends)
        gate = mm(x, self.w_gate) if self.kind == "swiglu" else None
        return mm(activate(self.kind, mm(x, self.w_in), gate), self.w_out)  # hidden: (N, hidden)


@torch.compiler.disable  # the experts' row counts are data: traced, every new routing would compile again
def per_expert(kind: str, x: torch.Tensor, counts: torch.Tensor, w_in: torch.Tensor, w_gate: torch.Tensor | None,
               w_out: torch.Tensor) -> torch.Tensor:
    """`Experts.forward` one product per expert, eager under torch.compile: x (N, C) sorted by expert -> (N, C)."""
    sizes = counts.tolist()

    def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.cat([part @ w[e] for e, part in enumerate(a.split(sizes))])
    gate = mm(x, w_gate) if kind == "swiglu" else None
    return mm(activate(kind, mm(x, w_in), gate), w_out)  # hidden: (N, hidden)


def grouped_mm_fits(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` computes x against these stacked weights: float32 on a CPU (not under
    torch.compile, whose tracing of it takes bfloat16 only), bfloat16 on a CUDA device of compute capability 9 or
    more; every row 16-byte aligned."""
    if x.device.type == "cpu":
        fits = x.dtype == torch.float32 and not torch.compiler.is_compiling()
    else:
        fits = x.device.type == "cuda" and x.dtype == torch.bfloat16 and \
            torch.cuda.get_device_capability(x.device)[0] >= 9
    return fits and all(w.shape[-1] * x.element_size() % 16 == 0 for w in weights) and \
        x.shape[-1] * x.element_size() % 16 == 0


class MoE(nn.Module):
    """The feed-forward sublayer of a mixture-of-experts block: routed experts, plus shared ones if
    model.n_shared_experts (one MLP as wide as all of them: the sum of their outputs)."""

    def __init__(self, cfg: GPTConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.k = layer, cfg.experts_per_token
        self.router = Router(cfg)
        self.experts = Experts(cfg, cfg.n_experts, cfg.expert_ff)
        self.shared = MLP(cfg, cfg.n_shared_experts * cfg.expert_ff) if cfg.n_shared_experts else None
        self.drop = nn.Dropout(cfg.dropout)
        self.stats: RouterStats | None = None
        """What the last forward measured, for the loss"""

    def residual_outputs(self) -> set[nn.Module]:
        """The shared experts' output projection; the routed experts draw their own (`Experts.draw_`)."""
        return set() if self.shared is None else self.shared.residual_outputs()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C)."""
        flat = x.reshape(-1, x.shape[-1])  # (N, C)
        weights, chosen, logits, probs = self.router(flat)  # (N, k), (N, k), (N, E), (N, E)
        pairs = chosen.reshape(-1)  # (N*k,) the expert of each (token, choice) pair
        order = pairs.argsort(stable=True)  # the pairs grouped by expert, tokens in order within each
        # (E,): index_add rather than bincount, which reads the largest id back to the host to size its output
        counts = torch.zeros(probs.shape[-1], dtype=torch.long, device=pairs.device).index_add_(
            0, pairs, torch.ones_like(pairs))
        rows = order // self.k  # (N*k,) the token of each sorted pair
        y = self.experts(flat[rows], counts) * weights.reshape(-1)[order, None].to(flat.dtype)  # (N*k, C)
        out = self.drop(torch.zeros_like(flat).index_add(0, rows, y.to(flat.dtype)))  # each token's weighted sum
        if self.shared is not None:
            out = out + self.shared(flat)  # (dropped inside the MLP)
        share = counts.float() / pairs.numel()  # f_e: no gradient, as in the Switch Transformer
        self.stats = RouterStats(self.layer, probs.shape[-1] * (share * probs.mean(0)).sum(),
                                 torch.logsumexp(logits, dim=-1).square().mean(), counts)
        return out.reshape(x.shape)


def router_stats(model: nn.Module) -> list[RouterStats]:
    """What each mixture-of-experts layer of `model` measured in its last forward, in block order."""
    return [m.stats for m in model.modules() if isinstance(m, MoE) and m.stats is not None]


@torch.no_grad()
def balance_routers(model: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor], size: torch.Tensor) -> None:
    """After an optimizer step, move each balancing router's bias (model.router_bias_rate) toward an even load:
    bias_e += size * rate * sign(mean - load_e) (model.router_bias_update=sign) or size * rate * (mean - load_e) /
    mean (error), the loads those its training forwards counted since the last update, then forget them. `reduce`
    averages a tensor over the data-parallel ranks in place (the engine layer's collective; identity on one
    process), so every rank takes the same step from the whole step's load; `size` (0-dim) is the step's size, the
    learning-rate schedule's factor (lr over the peak), 0 for a step the engine skipped, which moves no bias."""
    routers = [m for m in model.modules() if isinstance(m, Router) and m.bias_rate]
    if not routers:
        return
    # one collective for every layer; float64 holds any count exactly, and a mean over ranks keeps every sign
    loads = reduce(torch.stack([torch.zeros_like(r.score_bias, dtype=torch.long) if r.routed is None else r.routed
                                for r in routers]).double())  # (layers, E)
    mean = loads.mean(-1, keepdim=True)  # (layers, 1)
    # a mean of 0 (no routed token) is an even load: the error rule's 0 / 1 moves nothing, as sign(0) does
    steps = torch.stack([torch.sign(m - load) if r.bias_update == "sign" else (m - load) / m.clamp(min=1)
                         for r, m, load in zip(routers, mean, loads)]).float() * size  # (layers, E)
    for router, step in zip(routers, steps):
        router.score_bias += router.bias_rate * step
        router.routed = None


def with_router_terms(losses: Losses, stats: list[RouterStats], weight: float, aux_loss_coef: float,
                      router_z_loss_coef: float) -> Losses:
    """A micro-batch's `losses` with its mixture-of-experts layers' terms added: "moe_balance" and "router_z"
    (each the mean over the layers, token-weighted over micro-batches and ranks by `weight`), "expert_load_<i>"
    for block i (its most loaded expert over the mean; the step keeps its worst micro-batch and rank), and the
    "objective", which adds the two losses at their coefficients to what `losses` optimized."""
    if not stats:
        return losses
    balance = torch.stack([s.balance for s in stats]).mean()
    z_loss = torch.stack([s.z_loss for s in stats]).mean()
    objective = losses.optimized + aux_loss_coef * balance + router_z_loss_coef * z_loss
    terms = {**losses.terms, "moe_balance": Term(balance, Reduce.MEAN, weight),
             "router_z": Term(z_loss, Reduce.MEAN, weight),
             **{f"expert_load_{s.layer}": Term(s.load, Reduce.MAX) for s in stats},
             "objective": Term(objective, Reduce.MEAN, weight)}
    return Losses(terms, objective="objective")

"""The decoder-only family's keys: the shared transformer keys, and the options only this family has."""

import math
from dataclasses import dataclass
from typing import ClassVar

from lm.errors import ConfigError
from lm.models.config import NORM_POSITIONS, ROPE_SCALINGS, TransformerConfig, check_choice


def moe_block(layer: int, first_dense: int, every: int) -> bool:
    """Whether block `layer` (from 0) is a mixture of experts under model.moe_first_dense and model.moe_every:
    every `every`-th block after the first `first_dense`."""
    after = layer - first_dense
    return after >= 0 and (after + 1) % every == 0


_MIXTURE_KEYS = ("experts_per_token", "n_shared_experts", "expert_d_ff", "moe_every", "moe_first_dense", "router",
                 "router_renorm", "aux_loss_coef", "router_z_loss_coef", "router_bias_rate", "router_bias_update")
"""The keys only a mixture of experts (model.n_experts > 0) reads."""


@dataclass
class GPTConfig(TransformerConfig):
    """A decoder-only transformer: GPT-2 by default, Llama-style by options (see `TransformerConfig`)."""

    arch: str = "gpt"
    title: ClassVar[str] = "a decoder-only GPT"
    document_masking: ClassVar[bool] = True
    z_loss: ClassVar[bool] = True
    norm_positions: ClassVar[tuple[str, ...]] = (*NORM_POSITIONS, "output")
    """`output` (OLMo 2): each sublayer's output is normed before it joins the residual, x + norm(f(x)), and the
    stack ends in a final norm."""
    # the mixture-of-experts losses' weights and the balancing bias's update rule: a run can set its own over an
    # imported or resumed checkpoint's (router_bias_rate only between rates above 0: at 0 there is no bias; see
    # free_keys)
    training_keys: ClassVar[tuple[str, ...]] = (*TransformerConfig.training_keys, "aux_loss_coef", "router_z_loss_coef",
                                                "router_bias_update")
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (pos: rope)."""
    rope_scaling: str = "none"
    """Rotary frequencies stretched for a longer context: none; linear (every frequency divided by rope_factor);
    llama3 (Llama 3.1's: wavelengths longer than rope_original_context / rope_low_freq_factor divided by
    rope_factor, those shorter than rope_original_context / rope_high_freq_factor kept, a blend between)."""
    rope_factor: float = 1.0
    """How much rope_scaling stretches the long wavelengths (Llama 3.1: 8, Llama 3.2: 32)."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above rope_original_context / this are divided by rope_factor."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below rope_original_context / this are kept."""
    rope_original_context: int = 8192
    """llama3 scaling: the context the rotary frequencies were first trained at."""
    nope_interval: int = 0
    """Every nope_interval-th layer (for 4: the 4th, 8th, ...) attends without rotary positions (NoPE), as in
    SmolLM3; 0: every layer rotary (pos: rope)."""
    d_head: int = 0
    """Channels of each attention head; 0 means d_model / n_head. Qwen3 sets its own: queries are then
    n_head * d_head wide, which need not be d_model."""
    qkv_bias: bool = False
    """Biases on the query/key/value projection even without `bias`, as in Qwen2 (`bias` implies them)."""
    qk_norm: bool = False
    """RMSNorm on the queries and keys (learned weight), before rotary positions."""
    qk_norm_scope: str = "head"
    """What one qk_norm normalises: head (each head's channels: Qwen3, modded-nanogpt) or all (every head's
    channels of the projection together, as OLMo 2)."""
    logit_softcap: float = 0.0
    """Squash the logits into (-c, c) as c * tanh(logits / c), in float32 (Gemma 2, modded-nanogpt); 0: off."""
    loss_chunk: int = 0
    """Compute the output head and loss this many of the B*T positions at a time, recomputing each chunk's
    logits in backward, so the full (B*T, vocab) logits never exist. 0: off, the whole head at once."""

    n_experts: int = 0
    """Routed experts of each mixture-of-experts block (`lm.models.gpt.moe`); 0: every block has one dense MLP.
    Experts are feed-forward networks of model.mlp's kind without biases (as Mixtral's, Qwen3-MoE's, OLMoE's)."""
    experts_per_token: int = 2
    """The experts the router sends each token to (top-k)."""
    n_shared_experts: int = 0
    """Experts every token goes through beside its routed ones (DeepSeek, Qwen2-MoE), each expert_d_ff wide."""
    expert_d_ff: int = 0
    """Hidden units of each expert; 0 means model.d_ff's (4 * d_model, or Llama's 8/3 * d_model for swiglu)."""
    moe_every: int = 1
    """Which blocks after the first moe_first_dense are mixtures of experts: every moe_every-th (1: all of them)."""
    moe_first_dense: int = 0
    """How many blocks at the bottom keep a dense MLP (DeepSeek-V3: 3)."""
    router: str = "softmax"
    """softmax: the top-k of the softmax over the experts (Mixtral, Qwen3-MoE, OLMoE); sigmoid: the top-k of
    each expert's sigmoid score, their weights normalised to sum to 1 (DeepSeek-V3)."""
    router_renorm: bool = True
    """softmax router: rescale the k chosen weights to sum to 1 (Mixtral, Qwen3-MoE); false keeps the softmax's
    own (OLMoE)."""
    aux_loss_coef: float = 0.01
    """Weight in the objective of the load-balancing loss (the term moe_balance, 1 when the load is even)."""
    router_z_loss_coef: float = 0.0
    """Weight in the objective of the router z-loss (the term router_z): the mean squared log-sum-exp of the
    router logits (ST-MoE uses 1e-3)."""
    router_bias_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3; Wang et al. 2024): each router keeps a per-expert bias, added to
    its scores to choose the top k only (the chosen experts' weights stay the unbiased scores), and after every
    optimizer step moved toward an even load by this much times the learning-rate schedule's factor (lr over the
    peak: it warms up and decays with the learning rate), in the direction model.router_bias_update says, the loads
    counted over the step's micro-batches and ranks. The bias is part of the model (saved in checkpoints, used in
    evaluation and sampling). 0: no bias (DeepSeek-V3 used 0.001); combine with model.aux_loss_coef=0 for
    DeepSeek's recipe."""
    router_bias_update: str = "sign"
    """How model.router_bias_rate moves the bias: sign, by the rate toward an even load whatever the imbalance
    (DeepSeek-V3); error, by the rate times the relative imbalance, (mean load - load of e) / mean load, so an
    expert at twice the mean moves as far as under sign and one near the mean barely moves. With few tokens a
    step, sign turns the counts' noise into a random walk of the bias; error's steps shrink with it."""

    @property
    def expert_ff(self) -> int:
        """Hidden units of one expert."""
        return self.expert_d_ff or self.ff_dim

    def moe_layer(self, layer: int) -> bool:
        """Whether block `layer` (from 0) is a mixture of experts."""
        return self.n_experts > 0 and moe_block(layer, self.moe_first_dense, self.moe_every)

    @property
    def moe_layers(self) -> int:
        """How many blocks are mixtures of experts: one every moe_every after the first moe_first_dense."""
        return max(0, self.n_layer - self.moe_first_dense) // self.moe_every if self.n_experts else 0

    def depth_steps(self) -> list[tuple[dict[str, int], int]]:
        """A mixture of experts: dense blocks beyond the first, each one more of moe_first_dense, then periods of
        moe_every blocks beyond two (rotary or not, a block has the same parameters)."""
        if not self.n_experts:
            return super().depth_steps()
        periods = (self.n_layer - self.moe_first_dense) // self.moe_every
        return [({"moe_first_dense": 1, "n_layer": 1}, max(0, self.moe_first_dense - 1)),
                ({"n_layer": self.moe_every}, max(0, periods - 2))]

    def rotary_layer(self, layer: int) -> bool:
        """Whether block `layer` (from 0) rotates its queries and keys: not every nope_interval-th one."""
        return self.pos == "rope" and not (self.nope_interval and (layer + 1) % self.nope_interval == 0)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        check_choice("qk_norm_scope", self.qk_norm_scope, ("head", "all"))
        if self.rope_scaling != "none":
            if self.pos != "rope":
                raise ConfigError(f"model.rope_scaling: {self.rope_scaling} scales rotary positions; it needs "
                                  f"model.pos=rope, got {self.pos}")
            if not self.rope_factor > 0:
                raise ConfigError(f"model.rope_factor: must be above 0, got {self.rope_factor}")
        if self.nope_interval < 0:
            raise ConfigError(f"model.nope_interval: must be >= 0 (0: every layer rotary), got {self.nope_interval}")
        if self.nope_interval and self.pos != "rope":
            raise ConfigError(f"model.nope_interval: leaves rotary positions out of some layers; it needs "
                              f"model.pos=rope, got {self.pos}")
        if self.rope_scaling == "llama3":
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ConfigError(
                    f"model.rope_low_freq_factor: must be above 0 and below model.rope_high_freq_factor, got "
                    f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor}")
            if self.rope_original_context < 1:
                raise ConfigError(f"model.rope_original_context: must be at least 1, got {self.rope_original_context}")
        self._check_experts()
        if self.logit_softcap < 0:
            raise ConfigError(f"model.logit_softcap: must be >= 0 (0 = off), got {self.logit_softcap}")
        if self.loss_chunk < 0:
            raise ConfigError(f"model.loss_chunk: must be >= 0 (0 turns chunking off), got {self.loss_chunk}")

    def free_keys(self, saved: "GPTConfig") -> tuple[str, ...]:
        """`training_keys`, and router_bias_rate where both it and the checkpoint's are above 0: both models keep
        the bias, which only moves at another rate (at 0 there is none to load, or one to drop)."""
        biased = self.router_bias_rate and saved.router_bias_rate
        return (*self.training_keys, "router_bias_rate") if biased else self.training_keys

    def _check_experts(self) -> None:
        check_choice("router", self.router, ("softmax", "sigmoid"))
        check_choice("router_bias_update", self.router_bias_update, ("sign", "error"))
        for key in ("n_experts", "n_shared_experts", "expert_d_ff", "moe_first_dense"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model.{key}: must be >= 0, got {getattr(self, key)}")
        for key in ("aux_loss_coef", "router_z_loss_coef", "router_bias_rate"):
            if not 0 <= getattr(self, key) < math.inf:
                raise ConfigError(f"model.{key}: must be a finite number >= 0, got {getattr(self, key)}")
        if not self.n_experts:  # a dense model: a mixture's key away from its default would do nothing
            for key in _MIXTURE_KEYS:
                if (value := getattr(self, key)) != self.__dataclass_fields__[key].default:
                    raise ConfigError(f"model.{key}: {value!r} shapes or trains a mixture of experts, and the model "
                                      f"is dense; set model.n_experts > 0, or drop model.{key}")
        if self.router == "sigmoid" and not self.router_renorm:
            raise ConfigError("model.router_renorm: false keeps the softmax router's own weights, and the sigmoid "
                              "router always rescales its k scores to sum to 1; drop model.router_renorm")
        if self.moe_every < 1:
            raise ConfigError(f"model.moe_every: must be >= 1 (1: every block), got {self.moe_every}")
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise ConfigError(f"model.experts_per_token: {self.experts_per_token} experts per token of "
                              f"model.n_experts={self.n_experts}; it must be 1 to {self.n_experts}")
        if self.n_experts and not self.moe_layers:
            raise ConfigError(f"model.n_experts: {self.n_experts} experts, but no block of the {self.n_layer} "
                              f"(model.n_layer) is a mixture of experts with model.moe_first_dense="
                              f"{self.moe_first_dense} and model.moe_every={self.moe_every}")

"""The parallel section: how a run's ranks share the work (the engine, and the tensor-, pipeline-, context- and
expert-parallel sizes), checked alone; what it must agree with in the other sections is `JobConfig`'s to check."""

from dataclasses import dataclass

from lm.config.rules import one_of
from lm.errors import ConfigError

ENGINES = ("ddp", "fsdp", "deepspeed")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


@dataclass
class ParallelConfig:
    engine: str = "ddp"
    """How ranks share the work: ddp (replicated model), fsdp (FSDP2, sharded per block) or deepspeed (ZeRO)."""
    zero_stage: int = 0
    """deepspeed only: ZeRO stage 1 (optimizer state sharded), 2 (+ gradients) or 3 (+ parameters); 0 = not set."""
    cpu_offload: bool = False
    """fsdp and deepspeed: keep sharded parameters (fsdp) or optimizer state (deepspeed) in CPU memory."""
    deepspeed_config: str = ""
    """deepspeed only: a DeepSpeed JSON whose keys override the config generated from this job."""
    activation_checkpointing: int = 0
    """Recompute activations in the backward pass: 0 none, 1 every block (full), N every N-th block."""
    tp: int = 1
    """Tensor-parallel ranks (keep them within a node): each block's heads and hidden units, the embedding's and
    the head's vocabulary split over tp ranks, the sequence between blocks too. fsdp only; data parallelism
    (FSDP2) takes the rest of the world size, world size / (tp x cp x pp)."""
    dp_replicate: int = 1
    """HSDP: data-parallel groups that each shard the model (FSDP2) and hold the same shards as one another, their
    gradients all-reduced across groups; make one group a node (world size / dp_replicate ranks) to keep FSDP2's
    gathers inside it. fsdp only; the data-parallel ranks of a group shard (dp_shard) are the rest."""
    cp: int = 1
    """Context-parallel ranks: each window's tokens split over cp ranks (balanced: rank r holds the r-th and the
    r-th-from-last of 2 x cp slices), keys and values gathered in every attention layer; for long sequences. fsdp
    only, with tp and pp at 1; FSDP2 shards over the data- and context-parallel ranks together."""
    pp: int = 1
    """Pipeline-parallel ranks (they may span nodes): the model's layers cut into pp x pp_stages_per_rank stages;
    the micro-batches of train.micro_batch_size flow through them. fsdp only."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe (all forwards, then all backwards), 1f1b (one forward, one backward: less
    memory) or interleaved_1f1b (several stages per rank: a smaller bubble)."""
    pp_stages_per_rank: int = 1
    """Stages each pipeline rank holds: 1 for gpipe and 1f1b, 2 or more for interleaved_1f1b."""
    ep: int = 1
    """Expert-parallel ranks: the routed experts of every mixture-of-experts layer split over ep ranks taken from the
    data-parallel ranks that shard the model (dp_shard), each token sent to the rank of its experts and back; FSDP2
    shards each rank's experts over the dp_shard ranks holding the same ones. fsdp only, with pp and cp at 1; under
    tp every tensor-parallel rank holds its ep rank's experts whole. ep divides model.n_experts and dp_shard."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"parallel.engine: unknown engine {self.engine!r}; expected one of {list(ENGINES)}")
        if self.engine == "deepspeed" and self.zero_stage not in (1, 2, 3):
            raise ConfigError(f"parallel.zero_stage: deepspeed takes ZeRO stage 1, 2 or 3, got {self.zero_stage}")
        if self.engine != "deepspeed":
            for key, unset in (("zero_stage", 0), ("deepspeed_config", "")):
                if getattr(self, key) != unset:
                    raise ConfigError(f"parallel.{key}: only the deepspeed engine has it, but parallel.engine is "
                                      f"{self.engine}; set parallel.engine=deepspeed or drop parallel.{key}")
        if self.engine == "ddp" and self.cpu_offload:
            raise ConfigError("parallel.cpu_offload: the ddp engine keeps a whole model per rank and cannot offload; "
                              "use parallel.engine=fsdp or deepspeed")
        if self.activation_checkpointing < 0:
            raise ConfigError("parallel.activation_checkpointing: must be >= 0 (0 = none), "
                              f"got {self.activation_checkpointing}")
        if self.ep > 1 and self.engine != "fsdp":
            raise ConfigError(f"parallel.ep={self.ep}: expert parallelism shards the experts with FSDP2; expected "
                              f"parallel.engine=fsdp, got {self.engine} (whose ranks each hold every expert: set "
                              "parallel.ep=1 there)")
        for key, what in (("tp", "tensor parallelism"), ("pp", "pipeline parallelism"),
                          ("cp", "context parallelism"), ("dp_replicate", "HSDP"),
                          ("ep", "expert parallelism")):
            n = getattr(self, key)
            if n < 1:
                raise ConfigError(f"parallel.{key}: must be >= 1 (1 = no {what}), got {n}")
            if n > 1 and self.engine != "fsdp":
                raise ConfigError(f"parallel.{key}: {what} composes with FSDP2 (parallel.engine=fsdp); the "
                                  f"{self.engine} engine is data-parallel only. Set parallel.engine=fsdp or "
                                  f"parallel.{key}=1")
        self._check_pipeline()
        if self.cp > 1 and (self.tp > 1 or self.pp > 1):
            raise ConfigError("parallel.cp: context parallelism does not combine with parallel.tp or parallel.pp "
                              "yet; use it with FSDP2 alone (tp=1, pp=1)")
        if self.ep > 1 and (self.pp > 1 or self.cp > 1):
            # the pipeline engine shards its stages without the experts' meshes, and a router under cp would see
            # a slice of each sequence
            raise ConfigError(f"parallel.ep={self.ep}: expert parallelism does not combine with parallel.pp or "
                              "parallel.cp yet; expected parallel.pp=1 and parallel.cp=1 with ep > 1")

    def _check_pipeline(self) -> None:
        if self.pp_schedule in ZERO_BUBBLE:
            raise ConfigError(f"parallel.pp_schedule: {self.pp_schedule} is refused: with FSDP2 torch's zero-bubble "
                              "schedules run without error but compute wrong gradients (checked on torch 2.13); "
                              f"use one of {list(PP_SCHEDULES)}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"parallel.pp_schedule: expected {one_of(PP_SCHEDULES)}, got {self.pp_schedule!r}")
        interleaved = self.pp_schedule == "interleaved_1f1b"
        if interleaved and self.pp_stages_per_rank < 2:
            raise ConfigError(f"parallel.pp_stages_per_rank: interleaved_1f1b takes 2 or more stages per rank, got "
                              f"{self.pp_stages_per_rank}")
        if not interleaved and self.pp_stages_per_rank != 1:
            raise ConfigError(f"parallel.pp_stages_per_rank: {self.pp_schedule} runs one stage per rank, got "
                              f"{self.pp_stages_per_rank}; use parallel.pp_schedule=interleaved_1f1b for more")

    @property
    def pipeline_stages(self) -> int:
        """How many stages the model is cut into (1 without pipeline parallelism)."""
        return self.pp * self.pp_stages_per_rank if self.pp > 1 else 1

"""One training job from start to end in this process: the process group, the trainer, and the stop signals
a scheduler sends. What `lm.train` and `lm.finetune` run once they have a config."""

from lm.config import JobConfig
from lm.distributed.env import init_distributed
from lm.training.faults import install_faults
from lm.training.preemption import StopSignals
from lm.training.trainer import Trainer


def run_job(cfg: JobConfig) -> None:
    """Join the process group (torchrun's, or none), train `cfg` to its end or to a stop signal, leave the group."""
    # from the start: a scheduler's SIGTERM during setup (joining the group, building, loading) is kept and
    # honoured at the first log step, not lost
    with StopSignals() as signals:
        env = init_distributed(cfg.train.device)
        try:
            trainer = Trainer(cfg, env)
            install_faults(trainer)  # the fault-tolerance tests' LM_FAULT_* variables; nothing in a real run
            trainer.fit(signals)
        finally:
            env.close()

"""One training job from start to end in this process: the process group, the trainer, and the stop signals
a scheduler sends. What `lm.train` and `lm.finetune` run once they have a config."""

from lm.config import JobConfig
from lm.distributed.env import init_distributed, launched_world_size
from lm.distributed.float8 import check_float8_launch
from lm.distributed.layout import check_world
from lm.training.faults import install_faults
from lm.training.preemption import StopSignals
from lm.training.trainer import Trainer


def run_job(cfg: JobConfig) -> None:
    """Join the process group (torchrun's, or none) and train `cfg` to its end or to a stop signal.

    The group is left open for the tool to end the process with `lm.cli.exit_without_teardown`. Destroying
    it here would let the last reference to a gloo group go when the trainer does (DDP's reducer holds one),
    and gloo's destructor joins its worker thread while holding the GIL, which that thread may still need to
    release the last collective's tensors: a deadlock, seen as one rank of about 16 preempted 2-process runs
    that never exited after "stopped at step N". Kept in the registry until the process ends, no group is
    ever destroyed.
    """
    # from the start: a scheduler's SIGTERM during setup (joining the group, building, loading) is kept and
    # honoured at the first log step, not lost
    check_world(cfg, launched_world_size())  # a layout that does not fit: refused before any group forms
    check_float8_launch(cfg.train)  # float8 on a device that has none: refused as early
    with StopSignals() as signals:
        par = cfg.parallel
        env = init_distributed(cfg.train.device, tp=par.tp, pp=par.pp, cp=par.cp, dp_replicate=par.dp_replicate,
                               cpu_offload=par.cpu_offload)
        trainer = Trainer(cfg, env)
        install_faults(trainer)  # the fault-tolerance tests' LM_FAULT_* variables; nothing in a real run
        trainer.fit(signals)

"""Job configuration: the sections composed into `JobConfig` (job_config.py; the parallel section in parallel.py),
reading and writing them from YAML and the command line (load.py), and the rules every tool applies to them
(rules.py)."""

from lm.config.job_config import (
    CheckpointConfig,
    JobConfig,
    LogConfig,
    OptimConfig,
    ScheduleConfig,
    TaskConfig,
    TrainConfig,
)
from lm.config.load import (
    OneConfig,
    config_from_yaml,
    config_help,
    load_config,
    parse_cli,
    read_stored_config,
    save_config,
    saved_by_lm,
)
from lm.config.parallel import ENGINES, ParallelConfig
from lm.config.rules import config_diff, device_type, resolve_device, use_bf16

__all__ = [
    "ENGINES", "CheckpointConfig", "JobConfig", "LogConfig", "OneConfig", "OptimConfig", "ParallelConfig",
    "ScheduleConfig", "TaskConfig", "TrainConfig", "config_diff", "config_from_yaml", "config_help", "device_type",
    "load_config", "parse_cli", "read_stored_config", "resolve_device", "save_config", "saved_by_lm",
    "use_bf16",
]

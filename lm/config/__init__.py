"""Job configuration: the sections composed into `JobConfig` (job_config.py; the training sections in sections.py,
the parallel one in parallel.py), reading and writing them as YAML with overrides (load.py), a tool's command line
(command_line.py), and the rules every tool applies to them (rules.py)."""

from lm.config.command_line import OneConfig, config_help, parse_cli
from lm.config.job_config import JobConfig
from lm.config.load import config_from_yaml, load_config, read_stored_config, save_config, saved_by_lm
from lm.config.parallel import ENGINES, ParallelConfig
from lm.config.rules import config_diff, device_type, resolve_device, use_bf16
from lm.config.sections import CheckpointConfig, LogConfig, OptimConfig, ScheduleConfig, TaskConfig, TrainConfig

__all__ = [
    "ENGINES", "CheckpointConfig", "JobConfig", "LogConfig", "OneConfig", "OptimConfig", "ParallelConfig",
    "ScheduleConfig", "TaskConfig", "TrainConfig", "config_diff", "config_from_yaml", "config_help", "device_type",
    "load_config", "parse_cli", "read_stored_config", "resolve_device", "save_config", "saved_by_lm",
    "use_bf16",
]

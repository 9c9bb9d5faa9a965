"""The errors bad input can cause: one base class and one kind per area.

Every tool turns an `LMError` into one `error: ...` line and exit code 2 (`lm.cli.run`); any other
exception is a bug and keeps its traceback. Each kind also derives from the builtin it refines
(ValueError for a bad value, RuntimeError for a state that cannot go on), so callers that catch those
keep working. Messages name the file, key or value and what was expected.
"""


class LMError(Exception):
    """Base of every error that bad input causes."""


class ConfigError(LMError, ValueError):
    """A configuration value is missing, of the wrong type, or out of range; the message names the key."""


class DataError(LMError, ValueError):
    """Input or prepared data is missing, malformed or inconsistent; the message names the file or key."""


class TokenizerError(LMError, RuntimeError):
    """No rank file for an encoding could be found or verified (the message says how to install one), or a
    tokenizer.json cannot be read or names no end-of-sequence token."""


class CheckpointError(LMError, RuntimeError):
    """A checkpoint is missing, incomplete or incompatible; the message names the path."""


class TrainingError(LMError, RuntimeError):
    """Training cannot go on (too many non-finite steps, weights no longer finite); the message names
    the checkpoint to go back to."""


class PromptError(LMError, ValueError):
    """A prompt, or a number of tokens to sample, that the model cannot take; the message names the flag."""


class ExportError(LMError, ValueError):
    """The model config has no Hugging Face counterpart; the message names the keys and what each target needs."""


class MetricsError(LMError, ValueError):
    """A run's metrics log is missing or unreadable; the message names the file."""


class PlotError(LMError, ValueError):
    """A run directory or output path cannot be plotted; the message names it."""


class SweepError(LMError, ValueError):
    """A grid, a sweep directory or a run of a sweep is unusable; the message names it."""

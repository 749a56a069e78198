"""Every exception dsattn raises for a user's mistake or a limit reached. Imports nothing from
dsattn, so any module may use it. Scripts print these as one line; anything else is a bug and
keeps its traceback."""


class DsattnError(Exception):
    """Base of the errors a user can cause and fix (scripts print them as one line)."""


class ConfigError(DsattnError, ValueError):
    """A config value is unknown, mistyped or inconsistent; the message names the key."""


class CacheExhausted(DsattnError, RuntimeError):
    """A cache could not hold a write: a row reached init_cache's max_len."""


class CheckpointMismatch(DsattnError, ValueError):
    """A checkpoint belongs to a different model config."""


class NonFiniteLoss(DsattnError, FloatingPointError):
    """The training loss became NaN or inf."""


class InputError(DsattnError, ValueError):
    """An input a user gave (a prompt, a length, a data file) cannot be used as given."""


class CheckpointCorrupt(DsattnError, RuntimeError):
    """No checkpoint of a run directory loads; the message names each step and why."""


class RunDirLocked(DsattnError, RuntimeError):
    """Another live process is training into the run directory."""


class CheckpointWriteError(DsattnError, OSError):
    """A run's state could not be saved: a checkpoint (or the metrics.jsonl beside it) hit a
    full disk, a missing permission or an I/O error, in orbax's foreground or background
    commit. The message names the step, the cause and the last complete checkpoint."""

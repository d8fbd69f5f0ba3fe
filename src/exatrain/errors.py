"""Which failures are the user's to fix (one line, exit 2) and which are internal (traceback kept).

User-input errors: a config value or key (`ConfigError`), a Plan (`PlanError`), resuming
(`ResumeError`), a checkpoint the manifest refuses (`CheckpointError`), a launcher environment
(`LaunchError`), and missing or corrupt data: a `FileNotFoundError`, or a `ValueError` /
`IndexError` raised inside `exatrain.data` (the readers name file and sample). Anything else --
a `ValueError` from inside the model, a bug in exatrain -- is internal: the CLI says so and keeps
the traceback (printed, and in the run directory's `error_rank<R>.log`).
"""

from __future__ import annotations

import traceback

USER_ERROR_NAMES = frozenset({"ConfigError", "PlanError", "ResumeError", "CheckpointError",
                              "LaunchError", "FileNotFoundError", "NonFiniteLoss", "InitFromError",
                              "BadSampleError"})
_DATA_MODULE = "/exatrain/data/"


def _raised_in_data(tb_text: str) -> bool:
    """The innermost exatrain frame of a formatted traceback lies in exatrain/data/."""
    frames = [line for line in tb_text.splitlines() if line.strip().startswith('File "')
              and "/exatrain/" in line]
    return bool(frames) and _DATA_MODULE in frames[-1]


def is_user_error(exc: BaseException | None, tb_text: str = "") -> bool:
    """True for failures the user fixes by changing input (see the module docstring)."""
    if exc is None:
        return False
    if any(cls.__name__ in USER_ERROR_NAMES for cls in type(exc).__mro__):
        return True
    if isinstance(exc, (ValueError, IndexError)):
        tb_text = tb_text or "".join(traceback.format_tb(exc.__traceback__))
        return _raised_in_data(tb_text)
    return False

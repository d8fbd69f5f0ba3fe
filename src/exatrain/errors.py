"""Which failures are the user's to fix (one line, exit 2) and which are internal (traceback kept).

User-input errors: a config value or key (`ConfigError`), a Plan (`PlanError`), resuming
(`ResumeError`), a checkpoint the manifest refuses (`CheckpointError`), a launcher environment
(`LaunchError`), a run directory or data set `predict` cannot use (`PredictError`), and a
`FileNotFoundError`. A `ValueError` / `IndexError` is the user's when it was raised where input
is checked: inside `exatrain.data` (the readers name file and sample) or `exatrain.workloads`, or
in a constructor (`__init__`, `__post_init__`) of `exatrain.models` (a
model option that does not fit). Anything else -- a `ValueError` from a model's forward, a bug in
exatrain -- is internal: the CLI says so and keeps the traceback (printed, and in the run
directory's `error_rank<R>.log`).
"""

from __future__ import annotations

import traceback

USER_ERROR_NAMES = frozenset({"ConfigError", "PlanError", "ResumeError", "CheckpointError",
                              "LaunchError", "FileNotFoundError", "NonFiniteLoss", "InitFromError",
                              "BadSampleError", "PredictError",
                              "UnusedParameterError"})
_INPUT_MODULES = ("/exatrain/data/", "/exatrain/workloads/")
_CONSTRUCTORS = (" in __init__", " in __post_init__")


def _raised_checking_input(tb_text: str) -> bool:
    """The innermost exatrain frame of a formatted traceback checks input (see above)."""
    frames = [line for line in tb_text.splitlines() if line.strip().startswith('File "')
              and "/exatrain/" in line]
    if not frames:
        return False
    last = frames[-1]
    return any(m in last for m in _INPUT_MODULES) or \
        ("/exatrain/models/" in last and last.rstrip().endswith(_CONSTRUCTORS))


def is_user_error(exc: BaseException | None, tb_text: str = "") -> bool:
    """True for failures the user fixes by changing input (see the module docstring)."""
    if exc is None:
        return False
    if any(cls.__name__ in USER_ERROR_NAMES for cls in type(exc).__mro__):
        return True
    if isinstance(exc, (ValueError, IndexError)):
        tb_text = tb_text or "".join(traceback.format_tb(exc.__traceback__))
        return _raised_checking_input(tb_text)
    return False


_PEER_LOSS = ("connection closed by peer", "connection reset by peer", "remote worker crashing",
              "broken pipe")


def is_peer_loss(exc: BaseException | None) -> bool:
    """A collective failed because another rank went away: an echo, not the cause."""
    return exc is not None and any(text in str(exc).lower() for text in _PEER_LOSS)


def known_cause(exc: BaseException | None) -> str | None:
    """What to do about a failure whose cause is known from its message alone, or None.

    Today one: HDF5 refuses to create or open a file that another process holds open for
    writing ("unable to lock file"). Under a launcher every rank runs the user's whole script,
    so a file the script writes is written by every rank at once.
    """
    if exc is None:
        return None
    text = str(exc)
    if isinstance(exc, OSError) and "unable to lock file" in text:
        return ("another process holds this HDF5 file open for writing. Every rank runs your "
                "whole script, so a file written from it is written by all ranks at once: write "
                "it before the job, on one rank, or under a name of its own per rank (then "
                "os.replace it into place); setting HDF5_USE_FILE_LOCKING=FALSE only hides the "
                "collision")
    return None

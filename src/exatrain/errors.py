"""Which failures are the user's to fix (one line, exit 2) and which are internal (traceback kept).

Every error of the user's making derives from `UserError`: a config value, a Plan, a data set,
a staging directory, a resume, a checkpoint, a launcher environment, a refusal of `parallelize`,
a loader timeout, `predict`, `model.init_from`. The CLI sorts failures by type alone: a
`UserError` is printed as one line and exits 2 (a built-in model's check of its input raises
`ModelInputError`); anything else -- a `ValueError` from the user's own model's forward, a bug in
exatrain -- is internal: the CLI says so and keeps the traceback (printed, and
in the run directory's `error_rank<R>.log`).

`UserError` is a mixin: an error that callers catch as a `ValueError` or `FileNotFoundError`
stays one (`class ConfigError(UserError, ValueError)`). Each subclass's docstring is its entry in
the errors reference page (docs/hooks.py): the first paragraph says what it means, the paragraph
that starts "What to do:" the fix. The message of each raise names the value, the rank where it
matters, and the fix.
"""

from __future__ import annotations


class UserError(Exception):
    """An error of the user's making: input they fix (a config, a Plan, a file), not a bug.

    What to do: read the message; it names the value and what would work.
    """


class ConfigError(UserError, ValueError):
    """A config key or value that cannot be used (a TOML file, `--set`, or `et.fit`'s keywords).

    What to do: use the value the message proposes; every key, its type and default are in the
    [configuration reference](config.md).
    """


class DataError(UserError, ValueError):
    """A data set or file that cannot be read as asked: a wrong layout, shape, dtype or a corrupt
    sample; or options for writing one that do not fit.

    What to do: the message names the file (and sample); regenerate or convert it
    (`exatrain data NAME --out DIR`), or point `data.path` at the right files.
    """


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory named by the config or on the command line does not exist: a data
    set, a run directory, a system description.

    What to do: write it with the command the message names (`exatrain data NAME --out DIR` for a
    data set, or `data.generate = true`), or fix the path.
    """


class ArgumentError(UserError, ValueError):
    """A command-line argument of an exatrain command that cannot be used (`exatrain run
    --print-batch-script`, `plan`, `tune`, `report`).

    What to do: use a value the message lists; `exatrain COMMAND --help` shows them all.
    """


class ModelOptionError(UserError, ValueError):
    """A model option that the built-in model cannot be built with (a size that does not halve,
    a width that heads do not divide).

    What to do: set the `model.*` keys to values the message proposes.
    """


class ModelInputError(UserError, ValueError):
    """A batch that a built-in model (or its loss) cannot take: a shape, a number of channels or
    a length other than the ones the model was built for.

    What to do: the message names what the model expects and what it got; make the data match
    (the `data.*` keys, or your data set's samples), or build the model for the data (the
    `model.*` keys).
    """


class ModelCodeError(UserError, ValueError):
    """A user's model whose forward cannot run the way evaluation and prediction run it: a
    derivative (`torch.autograd.grad`) taken where they turn gradients off.

    What to do: the message names the forward and the change, e.g. the derivative inside
    `with torch.enable_grad():`.
    """


class LossError(UserError, ValueError):
    """The loss given to `et.fit` (or a `Task`) returned what a backward cannot start from: a
    tensor of several values (a loss with `reduction="none"`), or not a tensor; or it adds over
    the samples of a batch (`reduction="sum"`) under a Plan that cuts each batch into parts
    (data or shard replicas, pipeline micro-batches, `train.grad_accum`), where it would train
    differently from one process.

    What to do: return the batch-mean loss, one value: PyTorch's losses do by default
    (`reduction="mean"`); reduce a per-sample loss with `.mean()`.
    """


class ParallelizeError(UserError, ValueError):
    """`parallelize` cannot lay this model out under the Plan: a layer or option that the
    strategy refuses.

    What to do: the message names the module and the degree that would work; change the Plan
    (`plan.*`) or the `parallel.*` option it names.
    """


class SpatialSplitError(ParallelizeError):
    """A layer cannot be split over `plan.space` as asked: a spatial size the split does not
    divide, a kernel, stride or padding the halo exchange cannot serve, or a halo wider than a
    rank's block.

    What to do: use a `plan.space` that divides the sizes the message names, or a sample size
    (`data.*`, `model.size`) that the split divides.
    """


class TensorSplitError(ParallelizeError):
    """Tensor parallelism (1D, 3D, channel/filter) cannot split a layer of the model: a width the
    tensor degree does not divide, attention whose heads do not split, a skip connection the
    channel/filter split cannot carry.

    What to do: use a `plan.tensor` degree that divides the widths the message names, reshape
    attention as it says, or leave the named modules unsplit (`parallel.chanfilt_skip`).
    """


def is_user_error(exc: BaseException | None) -> bool:
    """True for failures the user fixes by changing input: a `UserError`, by type alone."""
    return isinstance(exc, UserError)


def relayed(exc: BaseException, doing: str) -> tuple[type, str]:
    """What the other ranks raise for `exc`, which stopped rank 0 while `doing`: broadcast this
    (class, message), and they `raise cls(message)`. The same class when the error is the user's,
    so that it is called theirs whichever rank's report arrives first; a RuntimeError otherwise."""
    cls = type(exc) if is_user_error(exc) else RuntimeError
    return cls, f"rank 0 could not {doing}: {type(exc).__name__}: {exc}"


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

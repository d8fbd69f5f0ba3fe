"""The set-up's looks at a user's model and data, before the first step: each runs the plain
model (or reads samples) on rank 0 and every rank acts on what it found (`rank_0_finds`), so the
layouts agree and a refusal reaches every rank before any work.

    find_reads_outside   weights a forward reads outside their layer (parallel/reads.py)
    check_collate        where a collate_fn's batches cannot go (workloads/samples.py)
    check_derivatives    a forward that differentiates (parallel/derivatives.py)
    check_the_loss_is_a_batch_mean   a loss that sums over the samples
    check_equals_plain   the laid-out model against the plain one (parallel/verify*.py)

`train.job.build` calls them in that order around the layout. Built-in models need none: the
tests check them.
"""

from __future__ import annotations

import math
import random
from typing import Callable

import numpy as np
import torch

from ..comm import broadcast_object
from ..data.batches import collate
from ..parallel.nested import map_tensors
from ..parallel.reads import mark_reads_outside, reads_outside
from .config import Config


def first_samples(workload, n: int):
    """The training set's first `n` samples (inputs, targets), collated as the loader does (a
    sample may hold NumPy arrays; a user's collate_fn)."""
    return (workload.collate_fn or collate)([workload.train_set[i] for i in range(n)])


def first_inputs(workload, n: int) -> "torch.Tensor":
    """The inputs of the training set's first `n` samples (`first_samples`)."""
    return first_samples(workload, n)[0]


def rank_0_finds(mesh, look: Callable, nothing):
    """What `look()` finds on rank 0, on every rank (broadcast): a look at the model and the
    first training samples at set-up, which every rank must then act on alike. A look that
    raises (a data set that cannot be read this way, a forward that fails) finds `nothing`:
    training meets the same failure and says why, and the other ranks never wait on a rank 0
    that failed. Random draws of the look (a data set's augmentation, from torch, NumPy or
    Python's random) leave the run's streams as they were."""
    found = nothing
    if mesh.rank == 0:
        streams = np.random.get_state(), random.getstate()
        try:
            with torch.random.fork_rng(devices=[]):
                found = look()
        except Exception:  # noqa: BLE001 - reported by the training step, where it belongs
            found = nothing
        finally:
            np.random.set_state(streams[0])
            random.setstate(streams[1])
    return broadcast_object(found, mesh.world)


def plain_device(workload, n: int):
    """Where the plain model is (the layout moves it later) when a set-up look can run it on
    the training set's first `n` samples; None where the set holds fewer, or the model is on the
    meta device (not materialised: nothing to run)."""
    where = next(workload.model.parameters(), torch.empty(0)).device
    return None if len(workload.train_set) < n or where.type == "meta" else where


def find_reads_outside(workload, mesh) -> None:
    """A user's model under shard or tensor: mark the weights its forward reads outside their
    layers (`F.linear(h, self.enc.weight.t())`), which those steps then keep whole
    (parallel/reads.py), from a forward of rank 0 on the data set's first two samples, where the
    model is (it is moved to the device later). Built-in models read none."""
    plan = mesh.plan
    if not workload.whole_outputs or workload.input_blocks or \
            (plan.shard == 1 and plan.tensor_degree == 1):
        return
    def look() -> dict:   # one rank looks, every rank marks alike (the layouts must agree)
        where = plain_device(workload, 1)
        if where is None:
            return {}
        inputs = workload.decode_inputs(first_inputs(workload, min(2, len(workload.train_set))))
        return reads_outside(workload.model, map_tensors(inputs, lambda t: t.to(where)))

    mark_reads_outside(workload.model, rank_0_finds(mesh, look, {}))


def check_collate(workload, config: Config, mesh) -> None:
    """A user's collate_fn (graphs of different sizes): refused on every rank, naming the fix,
    where the Plan or an option would cut or count its batches along one dim
    (`workloads.samples.collate_refusal`). Every rank decides alike: no look needed."""
    from ..errors import DataError
    from ..workloads.samples import collate_refusal

    if workload.collate_fn is None:
        return
    why = collate_refusal(mesh.plan, config)
    if why:
        raise DataError(f"{mesh.plan}: {why}")


def check_derivatives(workload, config: Config, mesh, training: bool = True) -> None:
    """A user's model whose forward differentiates (`torch.autograd.grad`: forces, a physics
    residual), found by two forwards of rank 0 on the training set's first two samples (as
    training and as evaluation run it: parallel/derivatives.py): refused on every rank before the first
    step where the Plan and settings cannot give its second derivatives, or where the derivative
    fails without gradients (as evaluation runs it), each naming the fix. A built-in workload
    is not probed: it says whether its forward differentiates (`Workload.differentiates`: the
    catalysis workload's forces). Prediction (`training=False`) takes first derivatives only:
    only the derivative without gradients is refused there."""
    from torch import nn

    from ..errors import ModelCodeError, ParallelizeError
    from ..parallel.derivatives import derivative_refusal, find_derivatives, no_grad_message
    from ..parallel.graph import graph_refusal

    def refusal(functorch: bool) -> str | None:
        batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                        for m in workload.model.modules())
        return derivative_refusal(type(workload.model).__name__, mesh.plan,
                                  zero_stage=config.parallel.zero_stage, functorch=functorch,
                                  batchnorm=batchnorm, options=config.parallel,
                                  optimizer=config.optim.name, compiled=bool(workload.compile),
                                  tensor_ok=graph_refusal(workload.model) is None)

    if not workload.whole_outputs:
        why = refusal(functorch=False) if workload.differentiates and training else None
        if why:
            raise ParallelizeError(why)
        return

    def look() -> tuple[str, str] | None:
        where = plain_device(workload, 1)
        if where is None:
            return None
        # two samples where there are: a training forward of one fails in a BatchNorm
        inputs = map_tensors(workload.decode_inputs(first_inputs(
            workload, min(2, len(workload.train_set)))), lambda t: t.to(where))
        found = find_derivatives(workload.model, inputs)
        if found.failed_without_grad is not None:
            return "no_grad", no_grad_message(workload.model, found.failed_without_grad)
        if not found.calls or not training:
            return None
        why = refusal(functorch=found.functorch > 0)
        return ("plan", why) if why else None

    found = rank_0_finds(mesh, look, None)
    if found:
        kind, message = found
        raise (ModelCodeError if kind == "no_grad" else ParallelizeError)(message)


def check_the_loss_is_a_batch_mean(workload, config: Config, mesh) -> None:
    """A user's loss under a Plan that cuts each batch into parts (data and shard replicas,
    pipe's micro-batches, train.grad_accum): each part's loss is computed on its samples and
    their gradients averaged, which equals one process only for a batch-mean loss. A loss that
    adds over the samples (reduction="sum") would make the gradients `parts` times smaller than
    one process's, silently; rank 0 tests it on the training set's first two samples
    (`workloads.user.summed_over_samples`) and every rank refuses it, naming the fix."""
    from ..errors import LossError
    from ..parallel.pipe.schedules import virtual_stages
    from ..workloads.user import summed_over_samples

    plan, options = mesh.plan, config.parallel
    micro = options.microbatches or 2 * plan.pipe * virtual_stages(
        options.pipe_schedule, options.pipe_virtual_stages) if plan.pipe > 1 else 1
    cuts = {"replicas": plan.data * plan.shard, "micro-batches": micro,
            "train.grad_accum": config.train.grad_accum}
    parts = math.prod(cuts.values())
    if not workload.whole_outputs or workload.input_blocks or parts == 1:
        return

    def look() -> tuple | None:
        where = plain_device(workload, 2)
        if where is None:
            return None
        x, y = first_samples(workload, 2)
        return summed_over_samples(workload.model, workload.loss_fn, map_tensors(
            workload.decode_inputs(x), lambda t: t.to(where)), y.to(where))

    found = rank_0_finds(mesh, look, None)
    if found:
        both, first, second = found
        raise LossError(
            f"the loss adds over the samples of a batch: on the training set's first two samples "
            f"it is {both:.6g}, the sum of theirs ({first:.6g} + {second:.6g}), where a batch "
            f"mean would be {(first + second) / 2:.6g} (reduction='sum'?). {plan} cuts each "
            f"batch into {parts} parts ({', '.join(f'{k} {n}' for k, n in cuts.items() if n > 1)}),"
            f" computes the loss of each on its samples and averages their gradients: with a sum "
            f"the gradients would be {parts} times smaller than one process's (SGD's steps with "
            f"them; Adam's where its eps, weight decay or gradient clipping matter) and each "
            f"logged loss a part's sum. Return the batch mean (reduction='mean', or divide the "
            f"sum by the batch's size); with SGD, multiply optim.lr by train.batch_size for the "
            f"steps the sum gave.")


def check_equals_plain(workload, model, config: Config, mesh) -> None:
    """A user's model under space or tensor, for training: before the first step, its laid-out
    forward on the training set's first sample against the plain model's (`workload.model`,
    still the plain one), refused on every rank where they differ (parallel/verify.py); under
    space (with data at most) their gradients too (parallel/verify_gradients.py). Rank 0
    reads the sample and every rank takes it from there (a data set's augmentation draws
    differently on each rank). Not under pipe (stages run on ranks of their own), where the
    data set reads blocks, or under fp8 (its rounding is not one process's);
    `parallel.check_plain = false` skips it. Built-in models are checked by the tests."""
    from ..parallel.verify import check_equals_plain as check
    from ..parallel.verify_gradients import check_gradients_equal
    from ..workloads.user import float64_input_named

    plan = mesh.plan
    if (plan.space_degree == 1 and plan.tensor_degree == 1) or plan.pipe > 1 or \
            not config.parallel.check_plain or config.parallel.precision == "fp8" or \
            not workload.whole_outputs or workload.input_blocks:
        return

    def look():   # on the host: every rank moves it where its model is
        if plain_device(workload, 1) is None:
            return None
        return workload.decode_inputs(first_inputs(workload, 1))

    x = rank_0_finds(mesh, look, None)
    if x is not None:
        with float64_input_named(x):
            check(workload.model, model, x, mesh)
            if plan.tensor_degree == 1 and plan.shard == 1 and plan.space_degree > 1:
                check_gradients_equal(workload.model, model, x, mesh)

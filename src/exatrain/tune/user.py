"""`et.plans`: which Plans fit a user's own model, and how fast each would step, before a run.

    import exatrain as et
    for p in et.plans(UNet3D(), sample_shape=(2, 64, 64, 64), world=8, batch=8)[:5]:
        print(p["plan"], p["memory_per_rank"]["total"], p["step_s"])

The model is traced at batch 1 under fake tensors, its memory traffic at batches 2 and 4 too
(`tune.spec.user_spec`: no real memory, no real compute), then every Plan of `world` ranks goes
through the planner's cost model (`tune.cost.predict`) and its search (`tune.search.rank_plans`),
exactly as `exatrain plan` does for the built-in models. Memory per rank (state, activations,
transient) comes from the model's own layers; step time from its FLOPs on the named system
(`tune/systems/*.toml`; "cpu-local" is the local machine once `exatrain plan --calibrate` has
measured it).

What it costs for a user's model: data, shard (ZeRO 1/2/3) and space Plans. Tensor and pipe are
refused as "not applicable" (the cost model knows them for transformer blocks and CosmoFlow only);
checkpointing variants are left out (exatrain does not know a user's model's blocks). A forward
that differentiates its outputs (forces by `torch.autograd.grad`) keeps only the Plans that train
it (parallel/derivatives.py): the others are refused with training's reason.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ArgumentError
from .layout import Options


def plans(model: nn.Module, example: torch.Tensor | None = None, *,
         sample_shape: tuple[int, ...] | None = None, world: int, batch: int,
         loss=None, system: str = "cpu-local", precision: str = "fp32",
         optimizer: str = "adamw", refused: bool = False) -> list[dict]:
    """Every valid Plan of `world` ranks for `model`, fastest predicted step first.

    Args:
        model: your `nn.Module` (its weights are not used; no real forward runs).
        example: an input batch (N, C, *spatial) or one sample; or give `sample_shape`.
        sample_shape: one sample's input shape (C, *spatial), e.g. (2, 64, 64, 64).
        world: ranks of the job.
        batch: the global batch (`train.batch_size`).
        loss: `loss(output)` to trace, for outputs of a batch of 1, 2 and 4 (a target of the
            output's batch size); None: a mean square of the output (F.mse_loss's cost).
        system: the system file the times and usable memory come from.
        precision, optimizer: as the config's parallel.precision and optim.name.
        refused: also return the refused Plans, each with its reason.

    Returns:
        One dict per (Plan, options): `plan`, `degrees`, `options`, `step_s`, `memory_per_rank`
        (bytes: state, activations, buffers, transient, total), `time_parts_s`,
        `bytes_by_axis`. With `refused=True`, a pair (ranked, refused).
    """
    from .search import rank_plans
    from .spec import user_spec
    from .systems import load_system

    if (example is None) == (sample_shape is None):
        raise ArgumentError("et.plans needs the input's shape: give example= (a batch or one "
                            "sample of inputs) or sample_shape=(C, *spatial), not both.")
    if example is None:
        example = torch.zeros((1, *sample_shape))
    elif not isinstance(example, torch.Tensor):
        raise ArgumentError(f"et.plans models a model of one input; example is a "
                            f"{type(example).__name__} (a model of several inputs). Plan it on "
                            "its main input's shape: example= that tensor alone, with a model "
                            "that takes it alone.")
    elif example.dim() < 2:
        raise ArgumentError(f"et.plans: example of shape {tuple(example.shape)} has no batch and "
                            "channel dims; give a batch (N, C, *spatial).")
    spec = user_spec(model, example, loss)
    base = Options(batch=batch, precision=precision, optimizer=optimizer)
    ranking = rank_plans(spec, world, load_system(system), base)
    ranked = [p.to_dict() for p in ranking.ranked]   # (no checkpointing: blocks unknown)
    if refused:
        return ranked, [r.to_dict() for r in ranking.refused]
    return ranked

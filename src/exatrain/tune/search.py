"""The Plan space: every Plan for N ranks, the options worth trying with each, and why some are refused.

Which Plans are valid is decided by `exatrain.plan` (`Plan.validate`, `Plan.require_implemented`):
the planner calls those rules, it does not restate them, so an axis that a later version lets
through (pipe, new compositions) appears here without a change. On top of them it checks what
only the model knows (indivisible shapes) and what only the system knows (memory):

  plan rule          PlanError from plan.py, its message
  indivisible        the global batch over data × shard (× micro-batches), heads and MLP width
                     over 1D tensor, the 3D grid over the widths, the sample grid over space,
                     the blocks over pipeline stages
  not applicable     space > 1 for a model without a spatial grid (a GPT)
  out of memory      predicted memory per rank above the system's usable memory

Enumeration: every assignment of N's prime factors to the axes pipe, data, shard, space (d, h, w)
and tensor (1D, or 3D x, y, z), i.e. all ordered factorisations; for each Plan the options that
change its cost (`option_variants`: ZeRO stage with shard, checkpointing none/full, micro-batches
under pipe). trainer stays 1: population
training is a different job, not a layout of one model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from ..parallel.options import zero_stage_refusal
from ..plan import Plan, PlanError
from .cost import predict
from .layout import Options
from .spec import ModelSpec
from .systems import System


@dataclass
class Refusal:
    plan: Plan
    options: Options
    kind: str          # plan rule | indivisible | not applicable | out of memory
    reason: str

    def to_dict(self) -> dict:
        return {"plan": str(self.plan), "options": self.options.label(), "kind": self.kind,
                "reason": self.reason}


def _factorisations(n: int, slots: int):
    """Every tuple of `slots` positive ints whose product is n."""
    if slots == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorisations(n // d, slots - 1):
                yield (d,) + rest


def all_plans(world: int, spatial: bool = True, tensor_3d: bool = True):
    """Every Plan of `world` ranks (trainer = 1); space only when `spatial`."""
    seen = set()
    for pipe, data, shard, rest in _factorisations(world, 4):
        space_opts = _factorisations(rest, 4) if spatial else [(1, 1, 1, rest)]
        for sd, sh, sw, t in space_opts:
            tensors = [t]
            if tensor_3d and t > 1:
                tensors += [xyz for xyz in _factorisations(t, 3) if sum(v > 1 for v in xyz) > 1]
            for tensor in tensors:
                plan = Plan(pipe=pipe, data=data, shard=shard, space=(sd, sh, sw), tensor=tensor)
                key = (pipe, data, shard, (sd, sh, sw), tensor)
                if key not in seen:
                    seen.add(key)
                    yield plan


def shape_problem(spec: ModelSpec, plan: Plan, options: Options) -> tuple[str, str] | None:
    """(kind, reason) when the model's shapes do not fit the Plan, else None."""
    if spec.extra.get("differentiates"):   # as `train.user_checks.check_derivatives` refuses it
        from ..parallel.derivatives import derivative_refusal
        from ..parallel.options import ParallelOptions
        settings = ParallelOptions(precision=options.precision, batchnorm=options.batchnorm,
                                   activation_checkpointing=options.checkpointing)
        why = derivative_refusal(spec.name, plan, zero_stage=options.zero_stage,
                                 functorch=spec.extra.get("differentiates_by_functorch", False),
                                 options=settings, optimizer=options.optimizer,
                                 tensor_ok=not spec.extra.get("tensor_refusal"))
        if why:
            return ("not applicable", why)
    replicas = plan.data * plan.shard
    m = options.microbatches or (2 * plan.pipe if plan.pipe > 1 else 1)
    if options.batch % (replicas * m):
        return ("indivisible", f"batch {options.batch} does not split over data×shard = "
                               f"{replicas}" + (f" × {m} micro-batches" if m > 1 else ""))
    if plan.space_degree > 1:
        if not spec.spatial_shape:
            return ("not applicable", f"{spec.name} has no spatial grid to split (space)")
        if spec.extra.get("space_refusal"):   # as `parallelize_spatial` refuses it
            return ("not applicable", spec.extra["space_refusal"])
        from ..parallel.spatial import SpatialSplitError, block_slices
        try:
            block_slices(spec.spatial_shape, plan.space, (0, 0, 0))
        except SpatialSplitError as exc:
            return ("indivisible", str(exc))
    t = plan.tensor_degree
    if t > 1 and spec.extra.get("tensor_refusal"):   # as `parallelize` refuses it (DimeNet++)
        return ("not applicable", spec.extra["tensor_refusal"])
    if t > 1 and spec.family == "cosmoflow":
        # channel/filter convolutions (`tune.chanfilt.cnn_tensor`), costed alone or with
        # data/shard; under space the switch point moves the split layer by layer, and under
        # pipe each stage converts on its own: neither is costed yet
        if plan.tensor_3d:
            return ("not applicable", f"{spec.name}: under the 3D grid convolutions stay "
                                      "whole; use a 1D tensor degree")
        if plan.space_degree > 1 or plan.pipe > 1:
            return ("not applicable", f"{spec.name}: channel/filter parallelism with space or "
                                      "pipe is not costed yet; check one Plan with "
                                      "`exatrain plan --plan ... --dry-run 0`")
    elif t > 1:
        if spec.family != "gpt":
            return ("not applicable", f"{spec.name}: tensor parallelism splits Linears; its "
                                      "cost is modelled for transformer blocks and CosmoFlow "
                                      "only")
        if plan.tensor_3d:
            # `convert._fits_pair`: plain layers' outputs over x·z, transposed ones' over y·z
            x, y, z = plan.tensor
            bad = [w for w in spec.widths if w % (x * z) or w % (y * z)]
            if bad or spec.heads % x:
                return ("indivisible", f"widths {spec.widths} / {spec.heads} heads do not split "
                                       f"over tensor_x·tensor_z={x * z}, "
                                       f"tensor_y·tensor_z={y * z}")
        elif spec.heads % t or any(w % t for w in spec.widths):
            return ("indivisible", f"{spec.heads} heads and widths {spec.widths} do not split "
                                   f"over tensor={t} (whole heads per rank)")
    if plan.pipe > 1 and not spec.pipe_layers:
        return ("not applicable", f"{spec.name}: pipeline stages are costed for the GPT and "
                                  "CosmoFlow layer lists only")
    if plan.pipe > 1 and spec.extra.get("tie_weights"):   # as the pipe split refuses it
        return ("not applicable", f"{spec.name}: its lm_head shares the token embedding's "
                                  "weight, which the first and last pipeline stages would each "
                                  "train (model.tie_weights = false unties it)")
    if plan.pipe > 1 and spec.blocks < plan.pipe:
        return ("indivisible", f"{spec.blocks} blocks cannot fill pipe={plan.pipe} stages")
    return None


def option_variants(plan: Plan, base: Options, blocks_known: bool = True) -> list[Options]:
    """The options that change a Plan's cost: ZeRO stage (shard), checkpointing (where the
    model's blocks are known: not a model traced whole, as a user's is), and under pipe the
    micro-batch count (the config's, else two per stage, and one sample per micro-batch)."""
    stages = (1, 2, 3) if plan.shard > 1 else (3,)   # (the stage means nothing without shard)
    ckpts = ("none", "full") if blocks_known else ("none",)
    micro = [base.microbatches]
    if plan.pipe > 1:
        replica = base.batch // (plan.data * plan.shard)
        if replica > 0 and replica not in micro and replica != 2 * plan.pipe:
            micro.append(replica)
    return [replace(base, zero_stage=z, checkpointing=c, microbatches=m)
            for z in stages for c in ckpts for m in micro]


@dataclass
class Ranking:
    ranked: list            # Prediction, fastest first
    refused: list           # Refusal
    considered: int

    def refusal_counts(self) -> dict[str, int]:
        return dict(Counter(r.kind for r in self.refused))


def rank_plans(spec: ModelSpec, world: int, system: System, base: Options,
               vary_options: bool = True, keep_rule_refused_costs: bool = False) -> Ranking:
    """Every (Plan, options) for `world` ranks: predicted and ranked, or refused with the reason."""
    ranked, refused, considered = [], [], 0
    for plan in all_plans(world, spatial=bool(spec.spatial_shape), tensor_3d=spec.family == "gpt"):
        variants = option_variants(plan, base, spec.family != "user") if vary_options \
            else [base]
        try:
            plan.validate(world)
            plan.require_implemented()
            rule = None
        except PlanError as exc:
            rule = str(exc)
        for options in variants:
            considered += 1
            if rule:
                refused.append(Refusal(plan, options, "plan rule", rule))
                continue
            refusal = zero_stage_refusal(plan, options.zero_stage, options.schedule)
            if refusal:  # what the strategies refuse at build time (parallel/options.py)
                refused.append(Refusal(plan, options, "plan rule", refusal))
                continue
            problem = shape_problem(spec, plan, options)
            if problem:
                refused.append(Refusal(plan, options, *problem))
                continue
            pred = predict(spec, plan, system, options, world)
            if pred.memory["total"] > system.usable_memory:
                refused.append(Refusal(plan, options, "out of memory",
                                       f"needs {_gib(pred.memory['total'])} per rank, "
                                       f"{system.name} has {_gib(system.usable_memory)} usable"))
                continue
            ranked.append(pred)
    ranked.sort(key=lambda p: p.step_s)
    return Ranking(ranked, refused, considered)


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


__all__ = ["Ranking", "Refusal", "all_plans", "option_variants", "rank_plans", "shape_problem"]

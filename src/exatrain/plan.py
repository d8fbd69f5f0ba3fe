"""Plan: how many ranks go to each axis of the named mesh.

A Plan is a pure value: it can be built, validated, compared and costed without any process group
(the planner enumerates thousands of them). `exatrain.init(plan)` turns one into a live `Mesh`.

Axes, outermost first (the innermost axes talk most often and so get neighbouring ranks):

    trainer, pipe, data, shard, space (d, h, w), tensor (x, y, z)

The rules for composing axes live here and only here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .errors import UserError

AXIS_ORDER = ("trainer", "pipe", "data", "shard", "space", "tensor")

# Axes whose strategies exist in this version.  A Plan that needs any other is refused by
# `require_implemented`, with a message saying so, rather than silently ignored.
IMPLEMENTED_AXES = frozenset({"trainer", "data", "pipe", "space", "shard", "tensor"})


class PlanError(UserError, ValueError):
    """A Plan that cannot run: its product is not the world size, or axes that do not compose.

    What to do: use the Plan the message proposes, or `plan.data = 0` to fill the ranks left;
    see [which axes compose](../concepts/plan.md#which-axes-compose).
    """


def _as_triple(value, name: str) -> tuple[int, int, int]:
    if isinstance(value, int):
        return (1, 1, value) if name == "space" else (value, 1, 1)
    value = tuple(value)
    if not 1 <= len(value) <= 3:
        raise PlanError(f"Plan.{name}={value!r}: give 1 to 3 degrees, e.g. {name}=(2, 2, 1).")
    if name == "space":
        # fewer than three spatial degrees are the innermost dims: (h, w) for 2D models
        return (1,) * (3 - len(value)) + value
    return value + (1,) * (3 - len(value))


@dataclass(frozen=True)
class Plan:
    """Degrees of parallelism per axis; their product is the world size.

    Attributes:
        trainer: independent trainers of a population (tournament training).
        pipe: pipeline stages (model depth).
        data: full replicas, each on its share of the batch.
        shard: ranks that split the batch and shard parameters, gradients and optimizer state
            (ZeRO-1/2/3).
        space: (d, h, w) blocks of each sample; a 2D model uses (1, h, w), `space=(2, 2)` means
            (1, 2, 2).
        tensor: an int for 1D (Megatron, channel/filter) tensor parallelism, or (x, y, z) for
            the 3D parallel matrix multiply.
    """

    trainer: int = 1
    pipe: int = 1
    data: int = 1
    shard: int = 1
    space: tuple[int, int, int] = (1, 1, 1)
    tensor: int | tuple[int, int, int] = 1

    def __post_init__(self):
        object.__setattr__(self, "space", _as_triple(self.space, "space"))
        if not isinstance(self.tensor, int):
            object.__setattr__(self, "tensor", _as_triple(self.tensor, "tensor"))
        for name, degree in self.degrees().items():
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise PlanError(f"Plan.{name} must be a positive integer, got {degree!r}.")

    # ---------------------------------------------------------------- arithmetic
    @property
    def tensor_3d(self) -> bool:
        """Whether `tensor` is the (x, y, z) grid of 3D tensor parallelism (an int: 1D)."""
        return not isinstance(self.tensor, int)

    @property
    def tensor_degree(self) -> int:
        return self.tensor if isinstance(self.tensor, int) else math.prod(self.tensor)

    @property
    def space_degree(self) -> int:
        return math.prod(self.space)

    def degrees(self) -> dict[str, int]:
        """Mesh dimensions, outermost first, with their degrees (space and tensor expanded)."""
        dims = {"trainer": self.trainer, "pipe": self.pipe, "data": self.data, "shard": self.shard}
        dims.update({f"space_{a}": n for a, n in zip("dhw", self.space)})
        if self.tensor_3d:
            dims.update({f"tensor_{a}": n for a, n in zip("xyz", self.tensor)})
        else:
            dims["tensor"] = self.tensor
        return dims

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees().values())

    def used_axes(self) -> set[str]:
        """Top-level axes with a degree above 1."""
        used = {a for a in ("trainer", "pipe", "data", "shard") if getattr(self, a) > 1}
        if self.space_degree > 1:
            used.add("space")
        if self.tensor_degree > 1:
            used.add("tensor")
        return used

    # ---------------------------------------------------------------- validation
    def validate(self, world_size: int) -> "Plan":
        """Raise PlanError unless this Plan runs on exactly `world_size` ranks."""
        if self.world_size != world_size:
            raise PlanError(
                f"{self} needs {self.world_size} ranks but the job has {world_size}. "
                f"{_suggest(self, world_size)}"
            )
        return self

    def require_implemented(self) -> "Plan":
        missing = sorted(self.used_axes() - IMPLEMENTED_AXES)
        if missing:
            raise PlanError(
                f"{self} uses the axis {', '.join(missing)}, whose strategy this version of exatrain "
                f"does not implement yet (implemented: {', '.join(sorted(IMPLEMENTED_AXES))}). "
                f"Set {' and '.join(f'{a}=1' for a in missing)} or use data parallelism."
            )
        refusal = composition_refusal(self)
        if refusal:
            raise PlanError(refusal)
        return self

    def intra_trainer(self) -> "Plan":
        """The Plan of one trainer: this Plan with trainer=1 (what each trainer runs)."""
        return Plan(pipe=self.pipe, data=self.data, shard=self.shard, space=self.space,
                    tensor=self.tensor)

    def __str__(self) -> str:
        parts = [f"{a}={getattr(self, a)}" for a in ("trainer", "pipe", "data", "shard")
                 if getattr(self, a) != 1]
        if self.space_degree > 1:
            parts.append(f"space={self.space}")
        if self.tensor_degree > 1:
            parts.append(f"tensor={self.tensor}")
        return f"Plan({', '.join(parts)})"

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def for_world(cls, world_size: int, **degrees) -> "Plan":
        """The Plan with the given degrees and `data` filling the rest of `world_size`."""
        partial = cls(**{k: v for k, v in degrees.items() if k != "data"})
        if world_size % partial.world_size:
            raise PlanError(
                f"{partial} uses {partial.world_size} ranks per replica, which does not divide the "
                f"world size {world_size}. {_suggest(partial, world_size)}"
            )
        return cls(data=world_size // partial.world_size, **{k: v for k, v in degrees.items()
                                                              if k != "data"})


# ---------------------------------------------------------------------- composition rules
# Which axes compose (the table for readers: docs/concepts/plan.md, "Which axes compose"). Every
# pair of implemented axes composes except those `composition_refusal` names, each with its reason
# and the nearest Plan that works. How gradients are reduced for each combination: parallel/apply.py.
def composition_refusal(plan: Plan) -> str | None:
    """Why `plan` combines axes that cannot run together, with the nearest Plan that works; None
    when its axes compose."""
    if plan.tensor_3d and plan.tensor_degree > 1 and plan.shard > 1:
        x, y, z = plan.tensor
        nearest = Plan(trainer=plan.trainer, pipe=plan.pipe, data=plan.data, space=plan.space,
                       tensor=(x, y, z * plan.shard))
        return (f"{plan}: under 3D tensor parallelism tensor_z already does what shard would: it "
                f"splits the batch and shards every split weight and its gradient ZeRO-3 style "
                f"over z. A shard axis on top would shard the same weights again with FSDP2, "
                f"whose per-parameter buckets cannot also sum the whole parameters' gradients "
                f"over tensor_z. Put the shard ranks on tensor_z: {nearest}.")
    if plan.tensor_3d and plan.tensor_degree > 1 and plan.space_degree > 1:
        x, y, z = plan.tensor
        nearest = Plan(trainer=plan.trainer, pipe=plan.pipe, data=plan.data, shard=plan.shard,
                       space=plan.space, tensor=x * y * z)
        return (f"{plan}: the 3D tensor grid and spatial parallelism in one model are not "
                f"implemented (the grid splits the batch over tensor_z, which the spatial "
                f"blocks do not expect). With space, use 1D tensor parallelism (channel/filter "
                f"for the late convolutions, column/row for the Linears): {nearest}.")
    return None


def _suggest(plan: Plan, world_size: int) -> str:
    """A sentence proposing a Plan that fits `world_size`, keeping as much of `plan` as possible."""
    others = plan.world_size // plan.data
    if world_size % others == 0:
        return f"Use data={world_size // others} to fill {world_size} ranks."
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return (f"The other axes multiply to {others}, which does not divide {world_size}; "
            f"pick degrees whose product divides it (divisors of {world_size}: {divisors}).")

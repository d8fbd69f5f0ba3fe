"""Train to a target quality: `train.target = "val_mae <= 0.124"` stops the run when reached."""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

from ..errors import ConfigError

_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}
_PATTERN = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(<=|>=|<|>)\s*([-+0-9.eE]+)\s*$")


@dataclass(frozen=True)
class Target:
    metric: str
    op: str
    value: float

    @classmethod
    def parse(cls, text: str) -> "Target":
        match = _PATTERN.match(text)
        if not match:
            raise ConfigError(f"train.target={text!r} is not 'METRIC OP NUMBER' with OP one of "
                              "<=, >=, <, > (for example \"val_mae <= 0.124\").")
        try:
            value = float(match[3])
        except ValueError:
            raise ConfigError(f"train.target={text!r}: {match[3]!r} is not a number.") from None
        return cls(match[1], match[2], value)

    def reached(self, metrics: dict) -> bool:
        """Whether `metrics` (one evaluation) meets the target; a missing metric is an error."""
        if self.metric not in metrics:
            raise ConfigError(f"train.target names {self.metric!r}, which the evaluation does not "
                              f"report; it reports {', '.join(sorted(metrics))}.")
        return _OPS[self.op](metrics[self.metric], self.value)

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.value:g}"

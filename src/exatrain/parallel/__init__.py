"""Parallel strategies, one module each; apply.parallelize applies them in a fixed order."""

from .apply import parallelize
from .data import data_parallel, unwrap

__all__ = ["parallelize", "data_parallel", "unwrap"]

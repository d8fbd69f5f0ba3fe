"""Workloads: one module per model family, each with ModelOptions, DataOptions and build().

  cosmoflow, deepcam, vit, gpt, gcn, qm9, catalysis   the built-in workloads
  base          what a workload hands the Trainer: model, data sets, loss, validation statistics
  metrics       validation metrics declared once, reduced exactly over batches and data axes
  user          a user's own model and data (et.fit, `exatrain run SCRIPT`)
  samples       what a user's data sets hold, checked before the first step; a collate_fn's batches

Imports: data, models, parallel, optim and the foundations; never train or above.
"""

from __future__ import annotations

import importlib

from ..errors import ConfigError

# name -> module; modules are imported on demand so one workload's dependencies never load another's.
WORKLOAD_MODULES = {
    "catalysis": "exatrain.workloads.catalysis",
    "cosmoflow": "exatrain.workloads.cosmoflow",
    "deepcam": "exatrain.workloads.deepcam",
    "gcn": "exatrain.workloads.gcn",
    "gpt": "exatrain.workloads.gpt",
    "qm9": "exatrain.workloads.qm9",
    "vit": "exatrain.workloads.vit",
}


def get_workload(name: str):
    """The built-in workload `name`, or a user's `module:function` / `file.py[:function]`."""
    from .user import is_user_spec, load_user_workload
    if is_user_spec(name):
        return load_user_workload(name)
    if name not in WORKLOAD_MODULES:
        import difflib
        close = difflib.get_close_matches(name, WORKLOAD_MODULES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"run.workload={name!r} is unknown; choose one of "
                          f"{', '.join(sorted(WORKLOAD_MODULES))}, or name your own build "
                          f"function as 'package.module:build' or 'path/to/file.py'.{hint}")
    return importlib.import_module(WORKLOAD_MODULES[name])

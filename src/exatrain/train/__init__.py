"""Training: the run's config, the Trainer and its parts, the composition root, fit.

  config        TOML files validated into dataclasses, `--set section.key=value`
  trainer       the loop around one step, read top to bottom
  step          TrainStep: forward/backward over micro-batches, unscale, finiteness, the update
  sampling, evaluation, records, hooks   the sample order; metrics; what a run reports; the
                points where a composed component (a population member) is called
  job           the composition root every entry point shares (config -> mesh -> workload ->
                model -> optimizer -> Trainer)
  user_checks   the set-up's looks at a user's model and data before the first step
  fit           the Python API (et.fit, et.launch); run: `exatrain run`'s rank entry (its own layer)
  checkpoints/  save, resume on any Plan, manifests, export
  resilience/   restarts, elastic re-formation, replica groups (torchft), watchdog, stops, policies

Imports: everything below it (optim, workloads, observe, population options); never
population's driver, infer, tune, bench or cli. `train.run` sits above population (it dispatches
to the population driver).
"""

from .config import Config, ConfigError, load_config
from .resilience.policies import NonFiniteLoss
from .trainer import Trainer

__all__ = ["Config", "ConfigError", "load_config", "NonFiniteLoss", "Trainer"]

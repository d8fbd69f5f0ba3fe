"""Config sections for what a run records about itself: [observe] and [mlperf]."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WandbOptions:
    """`[observe.wandb]`: the Weights & Biases run (with "wandb" in observe.trackers)."""
    project: str = ""            # empty: WANDB_PROJECT, else "exatrain"
    entity: str = ""             # team or user; empty: WANDB_ENTITY, else the account's default
    mode: str = ""               # offline | online | disabled; empty: WANDB_MODE, else offline
    name: str = ""               # run name; empty: WANDB_NAME, else the run directory's name
    group: str = ""              # empty: WANDB_RUN_GROUP, else a population's run directory name
    tags: list[str] = field(default_factory=list)  # added to the Plan/world/versions/device tags


@dataclass
class MLflowOptions:
    """`[observe.mlflow]`: the MLflow run (with "mlflow" in observe.trackers)."""
    tracking_uri: str = ""       # empty: MLFLOW_TRACKING_URI, else sqlite:///OUT_DIR/mlflow.db
    experiment: str = ""         # empty: MLFLOW_EXPERIMENT_NAME, else "exatrain"
    run_name: str = ""           # empty: the run directory's name
    tags: list[str] = field(default_factory=list)  # "key=value" (or "key") tags of the run


@dataclass
class ObserveOptions:
    # where every metrics.jsonl record also goes, from rank 0 at log steps: tensorboard | wandb |
    # mlflow (wandb and mlflow need the extras exatrain[wandb], exatrain[mlflow])
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    tensorboard: bool = True     # false: no event files even with "tensorboard" in trackers
    profile_steps: int = 0       # > 0: torch.profiler trace of this many steps (`--profile N`)
    profile_skip: int = 2        # steps to leave out first (warm-up, allocation), then 1 of warm-up
    profile_ranks: list[int] = field(default_factory=list)  # empty: every rank
    # bus bandwidth per axis watched during the run (train.bandwidth); a drop is reported once
    bandwidth_watch: bool = True
    bandwidth_drop_fraction: float = 0.1  # low: below this fraction of the axis's own median
    bandwidth_patience: int = 3           # low steps in a row that make a drop
    bandwidth_window: int = 50            # normal steps the median is taken over
    bandwidth_warmup: int = 3             # first steps left out of the median
    bandwidth_check_every: int = 5        # steps between the ranks' agreement (4 bytes/rank)
    bandwidth_min_bytes: int = 65536      # bus bytes per step below which an axis is not judged
    on_bandwidth_drop: str = "warn"       # warn | stop (checkpoint and stop after the step)
    wandb: WandbOptions = field(default_factory=WandbOptions)     # the W&B run (its own table)
    mlflow: MLflowOptions = field(default_factory=MLflowOptions)  # the MLflow run (its own table)


@dataclass
class MLPerfOptions:
    enabled: bool = False        # write RUN_DIR/mlperf.log (:::MLLOG lines, MLPerf HPC keys)
    benchmark: str = ""          # empty: the workload's MLPerf HPC name (cosmoflow, deepcam, oc20)
    organization: str = "exatrain"
    division: str = "open"       # closed | open
    status: str = "research"     # onprem | cloud | preview | research
    platform: str = ""           # empty: "<nodes>x<accelerator>"
    accelerators_per_node: int = 0  # 0: the local ranks of this job (GPUs on a node, CPU ranks)

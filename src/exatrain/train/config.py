"""Run configuration: TOML files validated into dataclasses, with `--set section.key=value`.

The defaults are the built-in example (`exatrain run` with no file): CosmoFlow 32³ with data
parallelism on two local ranks; examples/cosmoflow.toml spells the same job out.

The fixed sections (run, plan, train, optim, schedule) are defined here. The `model` and `data`
sections belong to the workload named by `run.workload`: each workload module defines its own
`ModelOptions` and `DataOptions` dataclasses, so an unknown key is caught there too.

An unknown section or key is an error that suggests the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..optim.kfac_settings import DEFAULTS as KFAC_DEFAULTS
from ..parallel.options import BATCHNORM_MODES, ParallelOptions
from ..plan import Plan
from ..observe.options import MLPerfOptions, ObserveOptions
from ..population.options import PopulationOptions
from ..population.options import validate as validate_population
from ..errors import ConfigError  # noqa: F401 - defined with the other user errors; used, re-exported


@dataclass
class RunOptions:
    workload: str = "cosmoflow"  # a built-in workload, or your own: "module:function", "file.py"
    name: str = ""              # run directory prefix; empty = the workload name
    out_dir: str = "runs"       # where run directories are made (RUN_NAME-DATE-TIME)
    seed: int = 0               # model init, sample order and dropout derive from it
    nproc: int = 2              # local ranks for `exatrain run` when no launcher is detected
    timeout_s: float = 600.0    # a collective waiting longer than this fails instead of hanging
    backend: str = "auto"       # auto | gloo | nccl
    host_memory: str = "keep"   # keep: freed host memory stays in the process for reuse (glibc
                                # mallopt; faster CPU steps) | return: malloc's defaults
    init_from: str = ""         # initial weights: a state dict (.pt) or .safetensors file;
                                # also accepted as model.init_from


@dataclass
class PlanOptions:
    trainer: int = 1            # independent trainers of a population (LTFB)
    pipe: int = 1               # pipeline stages
    data: int = 0               # 0: whatever the world size leaves after the other axes
    shard: int = 1              # ranks that share one sharded copy of the state (ZeRO)
    space: list[int] = field(default_factory=lambda: [1, 1, 1])  # blocks per sample over (d, h, w)
    tensor: list[int] = field(default_factory=lambda: [1])  # [t]: 1D (Megatron); [x, y, z]: 3D grid

    def resolve(self, world_size: int) -> Plan:
        tensor = self.tensor[0] if len(self.tensor) == 1 else tuple(self.tensor)
        degrees = dict(trainer=self.trainer, pipe=self.pipe, shard=self.shard,
                       space=tuple(self.space), tensor=tensor)
        if self.data == 0:
            return Plan.for_world(world_size, **degrees)
        return Plan(data=self.data, **degrees).validate(world_size)


@dataclass
class TrainOptions:
    steps: int = 2000           # optimizer steps; 0 = run `epochs` epochs (2000: the default
                                # CosmoFlow job, about 2 min on 2 idle cores)
    epochs: int = 1             # with steps = 0: passes over the training set (ignored otherwise)
    batch_size: int = 8         # global batch per optimizer step, over all replicas and micro-steps
    grad_accum: int = 1         # micro-steps per optimizer step
    clip_grad_norm: float = 0.0  # 0 = no clipping
    eval_every: int = 1000      # 0 = only at the end
    log_every: int = 100        # steps between records in metrics.jsonl and lines on the console
    checkpoint_every: int = 0   # 0 = only at the end
    checkpoint_keep: int = 2    # newest checkpoints kept in RUN_DIR/checkpoints; older ones deleted
    num_workers: int = -1       # loader worker processes per rank; -1 = the cores each rank
                                # has beyond its first, at most 8 (none without a spare core:
                                # the prefetch thread reads), 0 = none
    prefetch: int = 2           # batches loaded, copied and decoded ahead of the step in a
                                # background thread; 0 = on the training thread (all wait)
    target: str = ""            # e.g. "val_mae <= 0.124": stop when an evaluation reaches it
    checkpoint_async: bool = False  # write checkpoints in the background (DCP async_save)
    on_nonfinite: str = "stop"  # stop | skip: a NaN/Inf loss or gradient (see
                                # train/resilience/policies.py)
    max_nonfinite_skips: int = 10  # with on_nonfinite = skip: steps skipped before the next
                                   # non-finite one stops the run
    on_bad_sample: str = "stop"  # stop | skip: a corrupt or out-of-range sample (logged)


@dataclass
class OptimOptions:
    name: str = "adamw"         # adamw | adam | sgd | kfac
    lr: float = 1e-3            # for `schedule.base_batch_size`, scaled by `schedule.lr_scaling`
    weight_decay: float = 0.0   # adamw: decoupled decay; adam, sgd: L2 added to the gradient
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adam, adamw: decay rates
                                # of the first and second moment estimates
    momentum: float = 0.9       # sgd only
    eps: float = 1e-8           # adam, adamw: added to the denominator's square root
    impl: str = "auto"          # auto | fused | foreach | forloop: torch.optim's kernel; auto =
                                # fused where torch has it (one launch for every parameter, and
                                # a non-finite step skipped on the device, not read by the host;
                                # SGD on a CPU: for-loop, see optim.factory.optimizer_kernel)
    # kfac: K-FAC preconditioning before `kfac_base` (see optim.kfac and docs/how-to/kfac.md).
    # The defaults are the recipe that reached the default job's target fastest (0.75x tuned
    # AdamW's seconds, nine seeds), with `lr` at its default 1e-3.
    kfac_base: str = "adamw"    # sgd | adamw: the first-order update of preconditioned gradients
                                # (SGD at lr 0.02 never reached the default job's target)
    kfac_damping: float = KFAC_DEFAULTS.damping  # λ, Tikhonov damping: 0.1 preconditioned too
        # weakly; 1e-3 (KAISA's) saturates the default CosmoFlow's tanh head
    kfac_factor_decay: float = KFAC_DEFAULTS.factor_decay  # ξ of the factors' running average
        # A ← ξ·A + (1-ξ)·A_step
    kfac_factor_every: int = KFAC_DEFAULTS.factor_every  # steps between factor updates (every
        # step: the same curve, a dearer step)
    kfac_inverse_every: int = KFAC_DEFAULTS.inverse_every  # steps between inverse updates
        # (eigendecompositions or Cholesky factorisations)
    kfac_kl_clip: float = KFAC_DEFAULTS.kl_clip  # κ of KL clipping: the preconditioned update
        # is scaled by min(1, sqrt(κ / (lr² Σ ⟨update, gradient⟩)))
    kfac_grad_worker_fraction: float = KFAC_DEFAULTS.grad_worker_fraction  # 1/W:
        # memory-optimal .. 1: communication-optimal
    kfac_inverse: str = KFAC_DEFAULTS.inverse  # eigen | cholesky: damped inverses, n³/3 flops
        # against eigh's ~9n³ (n = 3,456: 2.5 s against 66-142 s on 2 cores)
    kfac_factor_positions: int = KFAC_DEFAULTS.factor_positions  # a conv's A from at most this
        # many positions per sample (0 = all; a 32³ input has 32,768)
    kfac_max_factor_dim: int = KFAC_DEFAULTS.max_factor_dim  # a factor wider than this is kept
        # diagonal (0 = all full): a 3D conv's A is C_in·27 wide, its preconditioning ~ C_in²
    kfac_matmul_dtype: str = KFAC_DEFAULTS.matmul_dtype  # auto | float32 | bfloat16: factor and
        # preconditioning products (auto: bfloat16 on a GPU of compute capability ≥ 8 and a CPU
        # with AVX512-BF16 or AMX, where it runs 2.2x float32's rate; float32 elsewhere; the
        # state stays float32)


@dataclass
class ScheduleOptions:
    warmup_steps: int = 10      # lr rises linearly over these first steps, then `decay` starts
    decay: str = "cosine"       # cosine | linear | constant
    min_lr_ratio: float = 0.0   # cosine | linear: the lr at the last step, as a fraction of lr
    lr_scaling: str = "none"    # none | linear | sqrt: scale lr by (batch / base_batch_size)^(1 | 1/2)
    base_batch_size: int = 0    # 0 = the configured batch size (no scaling)


@dataclass
class FaultToleranceOptions:
    enabled: bool = False       # replica groups over `data` that survive a group's loss (torchft)
    groups: int = 0             # replica groups; 0 = plan.data (one data replica per group)
    lighthouse: str = "auto"    # torchft lighthouse "http://host:port"; auto = TORCHFT_LIGHTHOUSE,
                                # as the launcher of the groups exports it
    batch: str = "keep"         # keep: the groups present also train on a missing group's
                                # samples (the uninterrupted run's batch; slower meanwhile) |
                                # shrink: the batch shrinks by the missing groups' share
                                # (sync = "step"; local_sgd, diloco: a missing group's skipped)
    min_replicas: int = 1       # fewest groups that may commit a step
    timeout_s: float = 10.0     # collective, commit and heal timeout: a hung group costs this much
    quorum_timeout_s: float = 60.0  # how long one quorum request may wait (startup, a restart)
    heartbeat_timeout_ms: int = 2000  # the lighthouse drops a silent group after this (a killed
                                      # group costs the others about this); <= 1000 x timeout_s
    sync: str = "step"          # step: gradients averaged every step | slow links: local_sgd
                                # (parameters averaged) or diloco (an outer Nesterov step on the
                                # averaged change) every sync_every steps
    sync_every: int = 20        # local_sgd | diloco: optimizer steps between synchronisations
    outer_lr: float = 0.7       # diloco: the outer SGD's learning rate (the DiLoCo paper's)
    outer_momentum: float = 0.9  # diloco: the outer SGD's Nesterov momentum (0: plain SGD)


FIXED_SECTIONS = {"run": RunOptions, "plan": PlanOptions, "train": TrainOptions,
                  "optim": OptimOptions, "schedule": ScheduleOptions,
                  "parallel": ParallelOptions, "population": PopulationOptions,
                  "observe": ObserveOptions, "mlperf": MLPerfOptions,
                  "fault_tolerance": FaultToleranceOptions}


@dataclass
class Config:
    """A whole run's configuration: one attribute per section of the TOML file (`config.train.steps`).

    Made by `load_config` (or by `et.fit` from its keyword sections); every key and default is
    in the [configuration reference](config.md).

    Attributes:
        run: `[run]`: workload, seed, ranks, output directory.
        plan: `[plan]`: the Plan's degrees.
        train: `[train]`: steps, batch, evaluation, checkpoints.
        optim: `[optim]`: the optimizer and its settings.
        schedule: `[schedule]`: the learning-rate schedule.
        parallel: `[parallel]`: how the strategies run (precision, ZeRO stage, ...).
        population: `[population]`: tournament training.
        observe: `[observe]`: profiles, trackers, checks.
        mlperf: `[mlperf]`: MLPerf logging.
        fault_tolerance: `[fault_tolerance]`: replica groups that survive a group's loss.
        model: `[model]`: the workload's model options.
        data: `[data]`: the workload's data options.
    """

    run: RunOptions
    plan: PlanOptions
    train: TrainOptions
    optim: OptimOptions
    schedule: ScheduleOptions
    parallel: ParallelOptions
    observe: ObserveOptions
    mlperf: MLPerfOptions
    population: PopulationOptions
    model: Any
    data: Any
    fault_tolerance: FaultToleranceOptions = field(default_factory=FaultToleranceOptions)

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in
                (*FIXED_SECTIONS, "model", "data")}


def _closest(word: str, choices) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" Did you mean {match[0]!r}?" if match else f" Valid: {', '.join(sorted(choices))}."


def _coerce(value, annotation, where: str):
    """Check `value` against a dataclass field type; ints are accepted where floats are."""
    origin = typing.get_origin(annotation)
    if origin is list:
        (item,) = typing.get_args(annotation)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}.")
        return [_coerce(v, item, where) for v in value]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation in (int, float, str, bool) and not isinstance(value, annotation) or \
            (annotation is int and isinstance(value, bool)):
        raise ConfigError(f"{where} must be {annotation.__name__}, got {value!r} "
                          f"({type(value).__name__}).")
    return value


def build_section(cls, values: dict, section: str):
    """Instantiate dataclass `cls` from `values`, rejecting unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown key {section}.{key}.{_closest(key, known)}")
        if dataclasses.is_dataclass(hints[key]):  # a table inside the section: [observe.wandb]
            if not isinstance(value, dict):
                raise ConfigError(f"{section}.{key} must be a table of keys, got {value!r}.")
            kwargs[key] = build_section(hints[key], value, f"{section}.{key}")
        else:
            kwargs[key] = _coerce(value, hints[key], f"{section}.{key}")
    return cls(**kwargs)


def parse_override(text: str) -> tuple[str, str, Any]:
    """"section.key=value" -> (section, key, value); the value is read as TOML, else a string."""
    path, sep, raw = text.partition("=")
    section, dot, key = path.strip().partition(".")
    if not sep or not dot or not key:
        raise ConfigError(f"--set {text!r}: write section.key=value, e.g. --set train.steps=100.")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, key, value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a TOML config (or the built-in default example when `path` is None), apply overrides."""
    from ..workloads import get_workload

    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; see examples/*.toml for ones "
                              "that do, or run `exatrain run` with no file for the default example.")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    for text in overrides:
        section, key, value = parse_override(text)
        table = raw.setdefault(section, {})
        *tables, key = key.split(".")  # observe.wandb.project: a key of a table in a section
        for name in tables:
            table = table.setdefault(name, {})
        table[key] = value
    if isinstance(raw.get("model"), dict) and "init_from" in raw["model"]:
        raw.setdefault("run", {})["init_from"] = raw["model"].pop("init_from")
    sections = {*FIXED_SECTIONS, "model", "data"}
    for section in raw:
        if section not in sections:
            raise ConfigError(f"unknown section [{section}].{_closest(section, sections)}")
        if not isinstance(raw[section], dict):
            raise ConfigError(f"[{section}] must be a table of keys, got {raw[section]!r}.")
    built = {name: build_section(cls, raw.get(name, {}), name) for name, cls in FIXED_SECTIONS.items()}
    try:
        workload = get_workload(built["run"].workload)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    built["model"] = build_section(workload.ModelOptions, raw.get("model", {}), "model")
    built["data"] = build_section(workload.DataOptions, raw.get("data", {}), "data")
    config = Config(**built)
    validate(config)
    return config


def validate(config: Config) -> None:
    """Checks across keys, with messages that name the values."""
    t, o, s, p = config.train, config.optim, config.schedule, config.parallel
    choices = {"optim.name": (o.name, ("adamw", "adam", "sgd", "kfac")),
               "optim.kfac_base": (o.kfac_base, ("sgd", "adamw")),
               "optim.impl": (o.impl, ("auto", "fused", "foreach", "forloop")),
               "optim.kfac_inverse": (o.kfac_inverse, ("eigen", "cholesky")),
               "optim.kfac_matmul_dtype": (o.kfac_matmul_dtype, ("auto", "float32", "bfloat16")),
               "schedule.decay": (s.decay, ("cosine", "linear", "constant")),
               "schedule.lr_scaling": (s.lr_scaling, ("none", "linear", "sqrt")),
               "run.backend": (config.run.backend, ("auto", "gloo", "nccl")),
               "run.host_memory": (config.run.host_memory, ("keep", "return")),
               "parallel.precision": (p.precision, ("fp32", "bf16", "fp16", "fp8")),
               "parallel.activation_checkpointing": (p.activation_checkpointing,
                                                     ("none", "full", "selective")),
               "parallel.batchnorm": (p.batchnorm, BATCHNORM_MODES),
               "parallel.branches": (p.branches, ("none", "data")),
               "parallel.compile_scope": (p.compile_scope, ("auto", "model", "blocks")),
               "parallel.channels_last": (p.channels_last, ("auto", "on", "off")),
               "parallel.cuda_graphs_scope": (p.cuda_graphs_scope, ("compiled", "step")),
               "train.on_nonfinite": (t.on_nonfinite, ("stop", "skip")),
               "train.on_bad_sample": (t.on_bad_sample, ("stop", "skip"))}
    if hasattr(config.data, "shuffle"):
        from ..workloads.base import SHUFFLE_MODES
        choices["data.shuffle"] = (config.data.shuffle, SHUFFLE_MODES)
    for where, (value, valid) in choices.items():
        if value not in valid:
            raise ConfigError(f"{where}={value!r} is not one of {', '.join(valid)}.{_closest(value, valid)}")
    positive = {"train.batch_size": t.batch_size, "train.grad_accum": t.grad_accum,
                "train.log_every": t.log_every, "run.nproc": config.run.nproc,
                "train.checkpoint_keep": t.checkpoint_keep}
    for where, value in positive.items():
        if value < 1:
            raise ConfigError(f"{where}={value} is out of range: it accepts whole numbers ≥ 1.")
    non_negative = {"train.steps": t.steps, "train.eval_every": t.eval_every,
                    "train.checkpoint_every": t.checkpoint_every, "train.prefetch": t.prefetch,
                    "train.max_nonfinite_skips": t.max_nonfinite_skips,
                    "schedule.warmup_steps": s.warmup_steps,
                    "schedule.base_batch_size": s.base_batch_size,
                    "optim.kfac_factor_positions": config.optim.kfac_factor_positions,
                    "optim.kfac_max_factor_dim": config.optim.kfac_max_factor_dim}
    for where, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{where}={value} is out of range: it accepts whole numbers ≥ 0 "
                              "(0 = off / the default).")
    if t.num_workers < -1:
        raise ConfigError(f"train.num_workers={t.num_workers} is out of range: give the loader "
                          "processes per rank (0 = none, on the training side), or -1 for a "
                          "number chosen from the cores each rank has.")
    if config.run.timeout_s <= 0:
        raise ConfigError(f"run.timeout_s={config.run.timeout_s} is out of range: it accepts "
                          "seconds > 0.")
    if t.steps < 0 or t.epochs < 1 and t.steps == 0:
        raise ConfigError(f"train.steps={t.steps}, train.epochs={t.epochs}: give steps > 0 or epochs ≥ 1.")
    if config.plan.pipe > 1:
        from ..parallel.pipe.schedules import check_schedule
        check_schedule(config.parallel.pipe_schedule)
        if t.grad_accum != 1:
            raise ConfigError(f"train.grad_accum={t.grad_accum} with plan.pipe={config.plan.pipe}: "
                              "the pipeline already accumulates over micro-batches; set "
                              "train.grad_accum=1 and parallel.microbatches instead.")
        if config.parallel.precision == "fp16":
            raise ConfigError("parallel.precision='fp16' with plan.pipe > 1 is not supported (no "
                              "loss scaling across stages); use 'bf16' or 'fp32'.")
        if config.parallel.pipe_balance not in ("params", "time"):
            raise ConfigError(f"parallel.pipe_balance={config.parallel.pipe_balance!r} must be "
                              "'params' or 'time'.")
        if config.parallel.microbatches < 0:
            raise ConfigError(f"parallel.microbatches={config.parallel.microbatches} must be >= 1 "
                              "(or 0: two per stage).")
    if config.parallel.zero_stage not in (1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={config.parallel.zero_stage} must be 1, 2 or 3 "
                          "(stage 0 is plain data parallelism: set plan.shard=1).")
    if o.lr <= 0:
        raise ConfigError(f"optim.lr={o.lr} must be positive.")
    if o.name == "kfac":
        _validate_kfac(config)
    if t.target:
        from ..observe.target import Target
        try:
            Target.parse(t.target)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    from ..observe.trackers import check_trackers
    try:
        check_trackers(config.observe)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        validate_population(config.population, config.plan.trainer)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if config.fault_tolerance.enabled:
        _validate_fault_tolerance(config)


def _validate_kfac(config: Config) -> None:
    """K-FAC runs under data and space only, without recomputation or fp16 loss scaling."""
    from types import SimpleNamespace

    from ..optim.kfac_settings import check_plan
    p = config.plan
    try:
        check_plan(SimpleNamespace(trainer=p.trainer, pipe=p.pipe, shard=p.shard,
                                   tensor=tuple(p.tensor)))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if config.parallel.activation_checkpointing != "none":
        raise ConfigError(f"optim.name='kfac' with parallel.activation_checkpointing="
                          f"{config.parallel.activation_checkpointing!r}: the recomputed forward "
                          "would count K-FAC's factors twice. Set it to 'none'.")
    if config.parallel.branches != "none" and config.plan.data > 1:
        raise ConfigError("optim.name='kfac' with parallel.branches='data': each branch runs on "
                          "its owner ranks only, and K-FAC needs every preconditioned layer on "
                          "every data rank. Set parallel.branches='none', or use optim.name="
                          "'adamw' or 'sgd' with the branches split.")
    if config.parallel.precision == "fp16":
        raise ConfigError("optim.name='kfac' with parallel.precision='fp16': the loss scale would "
                          "enter K-FAC's G factors. Use 'bf16' or 'fp32'.")


def _validate_fault_tolerance(config: Config) -> None:
    """[fault_tolerance]: what the replica groups (train.resilience.replicas) can run today."""
    f, p = config.fault_tolerance, config.plan
    if f.groups < 0 or (f.groups == 0 and p.data == 0):
        raise ConfigError(f"fault_tolerance.groups={f.groups}: name the number of replica "
                          "groups (>= 2), or set plan.data and leave groups = 0 (one per replica).")
    groups = f.groups or p.data
    if groups < 2:
        raise ConfigError(f"fault_tolerance.groups={groups}: one group has no peer to heal "
                          "from; use groups >= 2 (and plan.data a multiple of it).")
    if p.data and p.data % groups:
        fits = [g for g in range(2, p.data + 1) if p.data % g == 0]
        raise ConfigError(f"plan.data = {p.data} does not split into fault_tolerance.groups = "
                          f"{groups}; use groups = {' or '.join(map(str, fits)) or 'plan.data'}.")
    if p.trainer > 1 or p.pipe > 1:
        raise ConfigError(f"[fault_tolerance] with plan.trainer={p.trainer}, plan.pipe={p.pipe}: "
                          "replica groups run without populations and pipelines for now; set "
                          "both to 1, or fault_tolerance.enabled = false.")
    if f.batch not in ("keep", "shrink"):
        raise ConfigError(f"fault_tolerance.batch={f.batch!r} must be 'keep' or 'shrink'.")
    if getattr(config.data, "shuffle", "global") == "node":
        raise ConfigError('[fault_tolerance] with data.shuffle = "node": a group\'s slice of '
                          'the batch is read from the whole set; use data.shuffle = "global".')
    if not 1 <= f.min_replicas <= groups:
        raise ConfigError(f"fault_tolerance.min_replicas={f.min_replicas} must be between 1 and "
                          f"the {groups} groups.")
    if f.timeout_s <= 0 or f.quorum_timeout_s <= 0 or f.heartbeat_timeout_ms <= 0:
        raise ConfigError("fault_tolerance.timeout_s, quorum_timeout_s and heartbeat_timeout_ms "
                          "must be positive.")
    if f.heartbeat_timeout_ms > 1000 * f.timeout_s:
        raise ConfigError(f"fault_tolerance.heartbeat_timeout_ms={f.heartbeat_timeout_ms} is "
                          f"longer than timeout_s={f.timeout_s}: a dead group would fail the "
                          "others' collectives first; lower it or raise timeout_s.")
    _validate_sync(f)
    if f.lighthouse != "auto" and not f.lighthouse.startswith(("http://", "https://")):
        raise ConfigError(f"fault_tolerance.lighthouse={f.lighthouse!r} must be 'auto' or an "
                          "address such as 'http://host:29510'.")


SYNC_MODES = ("step", "local_sgd", "diloco")


def _validate_sync(f: FaultToleranceOptions) -> None:
    """fault_tolerance.sync and its settings (train.resilience.replica_sync)."""
    if f.sync not in SYNC_MODES:
        close = difflib.get_close_matches(str(f.sync), SYNC_MODES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"fault_tolerance.sync={f.sync!r} is not a synchronisation mode; "
                          f"{hint}use one of {', '.join(map(repr, SYNC_MODES))}.")
    if f.sync != "step" and (isinstance(f.sync_every, bool) or not isinstance(f.sync_every, int)
                             or f.sync_every < 1):
        raise ConfigError(f"fault_tolerance.sync_every={f.sync_every!r}: the optimizer steps "
                          f"between synchronisations under sync = {f.sync!r} must be an integer "
                          ">= 1 (e.g. 20; 1 synchronises every step).")
    if f.sync == "diloco" and not f.outer_lr > 0:
        raise ConfigError(f"fault_tolerance.outer_lr={f.outer_lr}: DiLoCo's outer learning "
                          "rate must be positive (the DiLoCo paper uses 0.7).")
    if f.sync == "diloco" and not 0 <= f.outer_momentum < 1:
        raise ConfigError(f"fault_tolerance.outer_momentum={f.outer_momentum}: DiLoCo's outer "
                          "Nesterov momentum must be in [0, 1) (the DiLoCo paper uses 0.9).")


def micro_batch_size(config: Config, replicas: int) -> int:
    """Samples per rank per micro-step; the global batch must split evenly."""
    per = replicas * config.train.grad_accum
    if config.train.batch_size % per:
        lo = max(per, config.train.batch_size // per * per)
        raise ConfigError(
            f"train.batch_size={config.train.batch_size} does not split over {replicas} data "
            f"replicas × {config.train.grad_accum} accumulation steps (= {per}); use a multiple "
            f"of {per}, e.g. {lo} or {lo + per}.")
    return config.train.batch_size // per

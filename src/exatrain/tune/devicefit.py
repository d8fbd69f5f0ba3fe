"""`exatrain plan --calibrate-from BENCH.json ...`: the planner beside a device's measured steps.

`exatrain bench device` writes, per case, the one-GPU step (`<case>_exatrain_step_s_median`, or
`<case>_exatrain_samples_per_s` with `<case>_batch`: samples/s = batch / median step) and peak
memory (`<case>_exatrain_peak_memory_bytes`, torch.cuda.max_memory_allocated) of exatrain's own
training path, with the file's precision and compile. For every case the planner has a model
for (GPT, CosmoFlow, the ViT; not DeepCAM), this predicts one rank's step and peak memory at the
case's config on a system's data sheet (`--system`, e.g. h100-infiniband), sets them beside the
measured ones, then fits the system's compute efficiency per kind (matmul, conv) to the measured
steps with `calibrate.fit_cases`, the fit `exatrain plan --calibrate` runs on the CPU, and writes
the calibrated system file.

What the fit holds fixed, and why:

  fixed costs     op_s, collective_s, fsdp_unit_s are not fitted (left uncalibrated): on one rank
                  there are no collectives or FSDP2 units, and op_s, the eager dispatch of each
                  aten operator, is not what a compiled step pays; with one case per kind there
                  would be no measurement left to tell it from the efficiency
  memory          nothing is fitted: the memory figures are the data sheet's predictions
  compile         the cost model has no term for it: the fitted efficiency is that of the
                  recorded steps (bf16 and torch.compile on the bench's cases)

Leave-one-out: each case is predicted from the fit of the others, where another case of its
compute kind remains (a kind measured once is fitted exactly and cannot be held out).

The bench's case configs live in `bench.device_cases`, a layer above this one: `CASES` mirrors
the full sizes of the cases the planner knows (`tests/test_planner_device.py` checks the two
agree). A run with other settings (`bench device --set model.preset=...`) names them in the JSON
as `<case>_sets`, a table of section.key -> value laid over the case's; a recorded case whose
parameter count (`<case>_params`) differs from the planner's model is refused.
"""

from __future__ import annotations

import json
import statistics
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ArgumentError, MissingFileError
from .systems import system_file, user_systems_dir

# name -> (workload, the bench's `--sizes full` overrides that shape the model and the batch)
CASES = {
    "cosmoflow": ("cosmoflow", {"model.size": 128, "model.base_channels": 32,
                                "model.conv_layers": 5, "model.batchnorm": False,
                                "model.channels_last": True, "train.batch_size": 16}),
    "vit": ("vit", {"model.patch_size": 8, "model.embed_dim": 384, "model.depth": 12,
                    "model.num_heads": 8, "train.batch_size": 8,
                    "data.height": 360, "data.width": 720}),
    "gpt_125m": ("gpt", {"model.preset": "125m", "train.batch_size": 8}),
    "gpt_1b": ("gpt", {"model.preset": "1.3b", "train.batch_size": 4}),
}
UNKNOWN = {"deepcam": "the planner has no model of DeepCAM (tune.spec knows gpt, cosmoflow, vit)"}


@dataclass(frozen=True)
class Recorded:
    """One case's exatrain figures from a bench JSON."""
    case: str
    batch: int
    step_s: float
    peak_bytes: float | None     # None: not recorded
    precision: str
    compile: bool
    params: int | None
    device: str
    torch: str
    source: str
    sets: tuple = ()             # (section.key, value) over the case's own (`<case>_sets`)


def _value(text: object) -> str:
    if isinstance(text, bool):
        return "true" if text else "false"
    return f'"{text}"' if isinstance(text, str) else str(text)


def read_bench(paths: list[str]) -> tuple[list[Recorded], list[tuple[str, str]]]:
    """The recorded cases of `exatrain bench device` JSON files, and (case, why) of those left
    out. One record per case, batch and settings (`--set`): a planner check measures each case
    at two batch sizes; the same run in two files: the later file's."""
    found: dict[tuple, Recorded] = {}
    skipped: dict[str, str] = {}
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise MissingFileError(f"--calibrate-from {path}: no such file; give the JSON "
                                   "`exatrain bench device --json PATH` wrote")
        data = json.loads(p.read_text())
        names = sorted({k.split("_exatrain_")[0] for k in data
                        if k.endswith(("_exatrain_step_s_median", "_exatrain_samples_per_s"))})
        if not names:
            raise ArgumentError(f"--calibrate-from {path}: no <case>_exatrain_step_s_median "
                                "in it; is it `exatrain bench device` output?")
        for name in names:
            if name in UNKNOWN or name not in CASES:
                skipped[name] = UNKNOWN.get(name, "not a case of `exatrain bench device` the "
                                                  f"planner knows ({', '.join(CASES)})")
                continue
            batch = int(data.get(f"{name}_batch") or CASES[name][1]["train.batch_size"])
            step = data.get(f"{name}_exatrain_step_s_median")
            if step is None:
                step = batch / data[f"{name}_exatrain_samples_per_s"]
            peak = data.get(f"{name}_exatrain_peak_memory_bytes")
            sets = tuple(sorted(data.get(f"{name}_sets", {}).items()))
            found[name, batch, sets] = Recorded(
                name, batch, float(step), None if peak is None else float(peak),
                str(data.get("precision", "fp32")), bool(data.get("compile", False)),
                data.get(f"{name}_params"), str(data.get("device", "?")),
                str(data.get("torch", "?")), str(p), sets)
    return list(found.values()), sorted(skipped.items())


def case_config(rec: Recorded):
    """The `exatrain run` config of a recorded case (the bench's overrides, its batch)."""
    from ..train.config import load_config
    workload, sets = CASES[rec.case]
    sets = {**sets, **dict(rec.sets), "run.workload": workload, "train.batch_size": rec.batch,
            "parallel.precision": rec.precision, "parallel.compile": rec.compile}
    return load_config(None, [f"{k}={_value(v)}" for k, v in sets.items()])


def _mape(errors: list[float]) -> float | None:
    return 100 * statistics.mean(abs(e) for e in errors) if errors else None


def compare(records: list[Recorded], system) -> dict:
    """Predictions on `system` beside the records, the fit of its compute efficiency per kind,
    the calibrated predictions and their leave-one-out errors (module doc)."""
    from ..plan import Plan
    from .calibrate import fit_cases, fitted_system
    from .cost import predict
    from .layout import Options
    from .overheads import TERMS
    from .spec import spec_from_config
    specs, options = [], []
    for rec in records:
        spec = spec_from_config(case_config(rec))
        if rec.params is not None and int(rec.params) != spec.params:
            raise ArgumentError(f"{rec.source}: {rec.case} has {rec.params:,} parameters, the "
                                f"planner's {spec.name} {spec.params:,}: the bench's case and "
                                "tune.devicefit.CASES differ; make them agree")
        specs.append(spec)
        options.append(Options(batch=rec.batch, precision=rec.precision))
    kinds = [s.compute_kind for s in specs]
    measured = [r.step_s for r in records]

    def predict_all(picked):
        def run(sys_):
            return [predict(specs[i], Plan(), sys_, options[i], 1) for i in picked]
        return run
    every = list(range(len(records)))
    sheet = predict_all(every)(system)
    bare = replace(system, overheads={})
    fit = fit_cases(predict_all(every), measured, kinds, bare, drop=TERMS)
    calibrated_system = fitted_system(bare, {"compute_factor": fit["compute_factor"],
                                             "overheads": {}})
    calibrated = predict_all(every)(calibrated_system)
    loo: list[float | None] = []
    for i in every:
        rest = [j for j in every if j != i]
        if kinds[i] not in {kinds[j] for j in rest}:
            loo.append(None)
            continue
        part = fit_cases(predict_all(rest), [measured[j] for j in rest],
                         [kinds[j] for j in rest], bare, drop=TERMS)
        held = fitted_system(bare, {"compute_factor": part["compute_factor"], "overheads": {}})
        loo.append(predict_all([i])(held)[0].step_s)
    rows = []
    for i, rec in enumerate(records):
        rows.append({
            "case": rec.case, "sets": dict(rec.sets), "model": specs[i].name, "params": specs[i].params,
            "kind": kinds[i], "batch": rec.batch, "precision": rec.precision,
            "compile": rec.compile, "device": rec.device, "torch": rec.torch,
            "source": rec.source, "step_measured_s": rec.step_s,
            "step_predicted_s": sheet[i].step_s, "step_error": sheet[i].step_s / rec.step_s - 1,
            "memory_measured_bytes": rec.peak_bytes,
            "memory_predicted_bytes": sheet[i].memory["total"],
            "memory_error": (sheet[i].memory["total"] / rec.peak_bytes - 1)
            if rec.peak_bytes else None,
            "step_calibrated_s": calibrated[i].step_s,
            "step_calibrated_error": calibrated[i].step_s / rec.step_s - 1,
            "step_held_out_s": loo[i],
            "step_held_out_error": None if loo[i] is None else loo[i] / rec.step_s - 1})
    held = [r["step_held_out_error"] for r in rows if r["step_held_out_error"] is not None]
    return {
        "system": system.name, "rows": rows,
        "step_mape": _mape([r["step_error"] for r in rows]),
        "memory_mape": _mape([r["memory_error"] for r in rows if r["memory_error"] is not None]),
        "memory_cases": sum(r["memory_error"] is not None for r in rows),
        "efficiency_before": {k: system.efficiency.get(k) for k in sorted(set(kinds))},
        "efficiency_after": {k: calibrated_system.efficiency[k] for k in sorted(set(kinds))},
        "step_mape_calibrated": _mape([r["step_calibrated_error"] for r in rows]),
        "step_mape_held_out": _mape(held), "held_out_cases": len(held),
        "not_held_out": [r["case"] for r in rows if r["step_held_out_error"] is None],
        "calibrated_system": calibrated_system}


def write_system(result: dict, base: str, out: str = "") -> Path:
    """The base system's file with the fitted [efficiency], named `<base>-measured`, the cases
    it was fitted on under [measured.cases], and step_error: the leave-one-out MAPE where a case
    could be held out."""
    import tomli_w
    raw = tomllib.loads(system_file(base).read_text())
    name = f"{raw['name']}-measured"
    devices = sorted({r["device"] for r in result["rows"]})
    raw["name"] = name
    raw["description"] = (f"{raw.get('description', raw['name'])}; compute efficiency fitted "
                          f"to one-rank steps measured on {', '.join(devices)} "
                          f"(exatrain plan --calibrate-from, {time.strftime('%Y-%m-%d')})")
    raw["efficiency"] = {**raw.get("efficiency", {}),
                         **{k: float(v) for k, v in result["efficiency_after"].items()}}
    raw["measured"] = {"cases": {r["case"]: {
        "batch": r["batch"], **({"sets": r["sets"]} if r["sets"] else {}),
        "precision": r["precision"], "compile": r["compile"],
        "torch": r["torch"], "step_s": r["step_measured_s"],
        "step_predicted_datasheet_s": r["step_predicted_s"],
        "step_predicted_calibrated_s": r["step_calibrated_s"],
        **({"peak_memory_bytes": r["memory_measured_bytes"]}
           if r["memory_measured_bytes"] else {}),
        "source": Path(r["source"]).name} for r in result["rows"]}}
    if result["step_mape_held_out"] is not None:
        raw["overheads"] = {**raw.get("overheads", {}),
                            "step_error": result["step_mape_held_out"] / 100}
    path = Path(out) if out else user_systems_dir() / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    held = (f"its leave-one-out MAPE over {result['held_out_cases']} case(s)"
            if result["step_mape_held_out"] is not None else "none: too few cases to hold one out")
    header = ("# Written by `exatrain plan --calibrate-from` from the `exatrain bench device` "
              f"JSON of {', '.join(sorted({Path(r['source']).name for r in result['rows']}))}.\n"
              f"# [efficiency]: {raw['name'].removesuffix('-measured')}'s data-sheet factors "
              "fitted to the measured one-rank steps (the recorded precision and compile);\n"
              "# everything else is the data sheet's. [overheads] step_error: " + held + ".\n")
    path.write_bytes(header.encode() + tomli_w.dumps(raw).encode())
    return path

"""The pipeline benchmark's memory case: a GPT that fits a per-rank cap only with three axes.

Search (predicted, no training): GPTs of L = 8 blocks, context T = 128, byte vocabulary, widths
E = 128, 192, ... (heads of 64), global batch B = 32, AdamW fp32. For each, the planner's cost
model (`tune.cost.predict`: parameters, gradients and optimizer state, activations of the
micro-batches in flight, communication buffers, transients) gives the peak bytes per rank of
every 8-rank Plan the Plan rules accept over data, pipe, shard (ZeRO-3) and 1D tensor. The case
is the widest GPT for which `Plan(pipe=2, tensor=2, shard=2)` fits the cap and no Plan with
fewer axes > 1 does (the cap: `--memory-cap-mib`).

If no width qualifies (the cost model can rank a Plan with fewer axes at or below the three-axis
one at every width: on 8 ranks, Plan(pipe=2, shard=4) keeps the same 16Ψ/8 state and splits the
batch further), `memory_width` is null and the measurement below runs at E = 256.

Measurement: that GPT trains two AdamW steps under the three-axis Plan on 8 gloo ranks (one
thread each); `state_bytes_per_rank` is the largest rank's parameters + gradients + optimizer
state at the optimizer step (`observe.memory_meters.state_bytes`, storage actually held), against
`state_bytes_formula`, the cost model's state term for the busiest stage: the ZeRO-3 formula
16·Ψ_stage/N over the stage's tensor-parallel pieces Ψ_stage (ZeRO paper; Ψ padded to whole
FSDP2 chunks) plus Adam's step counters.
"""

from __future__ import annotations

import tempfile

THREE = dict(pipe=2, tensor=2, shard=2)
LAYERS, TOKENS, BATCH, MICRO = 8, 128, 32, 8


def _gpt_config(width: int):
    from ..models.gpt import GPTConfig
    return GPTConfig(vocab_size=256, block_size=TOKENS, n_layer=LAYERS, n_embd=width,
                     n_head=width // 64, bias=False)


def _options():
    from ..tune.layout import Options
    return Options(batch=BATCH, microbatches=MICRO, zero_stage=3)


def fewer_axis_plans(world: int = 8) -> list:
    """Every accepted Plan of `world` ranks over data, pipe, shard, 1D tensor with < 3 axes > 1."""
    from ..plan import composition_refusal
    from ..tune.search import all_plans
    plans = []
    for plan in all_plans(world, spatial=False, tensor_3d=False):
        used = sum(d > 1 for d in (plan.pipe, plan.data, plan.shard, plan.tensor_degree))
        if used < 3 and composition_refusal(plan) is None:
            plans.append(plan)
    return plans


def search(cap_bytes: float, widths=range(128, 2049, 64)) -> dict:
    """The widest GPT that fits `cap_bytes` per rank only under the three-axis Plan."""
    from ..plan import Plan
    from ..tune.cost import predict
    from ..tune.spec import gpt_spec
    from ..tune.systems import load_system

    system, options, three = load_system("cpu-local"), _options(), Plan(**THREE)
    others = fewer_axis_plans()
    best = None
    for width in widths:
        spec = gpt_spec(_gpt_config(width))
        mine = predict(spec, three, system, options).memory
        fewest = min(((predict(spec, p, system, options).memory["total"], p) for p in others),
                     key=lambda pair: pair[0])
        if mine["total"] <= cap_bytes < fewest[0]:
            best = {"width": width, "params": spec.params, "predicted_peak_bytes": mine["total"],
                    "state_bytes_formula": mine["state"],
                    "best_fewer_axes_plan": str(fewest[1]),
                    "best_fewer_axes_peak_bytes": fewest[0]}
        if mine["total"] > cap_bytes:
            break
    return best or {}


def _train_rank(width: int, directory: str) -> dict:
    from ..train.config import load_config
    from ..train.run import setup

    config = load_config(None, [
        "run.workload='gpt'", f"run.out_dir='{directory}/runs'", f"data.path='{directory}/text'",
        "data.generate=true", "data.max_bytes=200000", "data.val_samples=8",
        f"model.n_layer={LAYERS}", f"model.n_embd={width}", f"model.n_head={width // 64}",
        f"model.block_size={TOKENS}", "model.bias=false", f"train.batch_size={BATCH}",
        "train.steps=2", "train.eval_every=0", "train.log_every=1", "optim.name='adamw'",
        "plan.pipe=2", "plan.tensor=2", "plan.shard=2", f"parallel.microbatches={MICRO}",
        "parallel.zero_stage=3"])
    mesh, trainer = setup(config)
    try:
        trainer.fit()
        return {"state": trainer.last_state_bytes["total"]}
    finally:
        mesh.close()


def run_memory_case(cap_mib: float) -> dict:
    """Figures `memory_*` of `exatrain bench pipeline` (see the module docstring)."""
    from ..launch import spawn

    from ..plan import Plan
    from ..tune.cost import predict
    from ..tune.spec import gpt_spec
    from ..tune.systems import load_system

    cap = cap_mib * 2 ** 20
    found = search(cap)
    result = {"memory_cap_bytes": cap, "memory_plan": str(Plan(**THREE)),
              "memory_width": found.get("width")}
    result.update({f"memory_{k}": v for k, v in found.items() if k != "width"})
    width = found.get("width", 256)
    spec = gpt_spec(_gpt_config(width))
    formula = predict(spec, Plan(**THREE), load_system("cpu-local"), _options()).memory["state"]
    with tempfile.TemporaryDirectory() as directory:
        ranks = spawn(_train_rank, 8, args=(width, directory))
    measured = max(r["state"] for r in ranks)
    result.update(memory_measured_width=width, state_bytes_per_rank=measured,
                  state_bytes_formula=formula, state_bytes_ratio=measured / formula)
    return result

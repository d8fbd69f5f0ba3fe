"""The cost model against real ranks: bytes per axis equal the ledger's, model state equals
`state_bytes`, and the predicted memory per rank is near the measured peak (state when the step
begins + StepPeak), for every strategy on 2 ranks (one spawned function runs all the cases)."""

from harness import run_ranks

from exatrain.plan import Plan
from exatrain.train.config import load_config
from exatrain.tune.cost import Options, predict
from exatrain.tune.spec import spec_from_config
from exatrain.tune.systems import load_system

GPT = ["run.workload=gpt", "model.preset=1m", "model.block_size=64", "train.batch_size=4"]
COSMO = ["run.workload=cosmoflow", "model.size=32", "train.batch_size=2"]
VIT = ["run.workload=vit", "data.height=16", "data.width=32", "model.embed_dim=32",
       "model.depth=2", "model.num_heads=2", "train.batch_size=2"]
CASES = [(GPT, Plan(data=2), Options(batch=4)),
         (GPT, Plan(data=2), Options(batch=4, checkpointing="full")),
         (GPT, Plan(shard=2), Options(batch=4, zero_stage=1)),
         (GPT, Plan(shard=2), Options(batch=4, zero_stage=2)),
         (GPT, Plan(shard=2), Options(batch=4, zero_stage=3)),
         (GPT, Plan(tensor=2), Options(batch=4)),
         (GPT, Plan(pipe=2), Options(batch=4)),
         (COSMO, Plan(data=2), Options(batch=2)),
         (COSMO, Plan(space=(2, 1, 1)), Options(batch=2)),
         (VIT, Plan(data=2), Options(batch=2)),
         (VIT, Plan(shard=2), Options(batch=2, zero_stage=3))]


def _all_cases(cases):
    from exatrain.mesh import init
    from exatrain.tune.measure import measure_on
    out, mesh = [], None
    for overrides, plan, options in cases:   # one process group, a new mesh (and ledger) per Plan
        mesh = init(plan)
        out.append(measure_on(mesh, load_config(None, overrides), options, 0))
    mesh.close()
    return out


def test_predictions_match_measured_bytes_state_and_memory():
    per_rank = run_ranks(2, _all_cases, CASES)
    system = load_system("cpu-local")
    for i, (overrides, plan, options) in enumerate(CASES):
        spec = spec_from_config(load_config(None, overrides))
        pred = predict(spec, plan, system, options)
        ranks = [r[i] for r in per_rank]
        what = f"{spec.name} {plan} {options.label()}"
        ledger = {a: b for a, b in ranks[0]["ledger"].items() if b}
        assert ledger == pred.bytes_by_axis, what
        for rank, r in enumerate(ranks):   # under pipe, rank r holds stage r
            stage = pred.memory_by_stage[rank if plan.pipe > 1 else 0]
            # the model's figure is the busiest rank's: ViT's pos_embed (1 row) leaves rank 1
            # of ZeRO-3 an empty shard, so that rank holds less
            assert r["state"]["total"] <= stage["state"], (what, rank)
        busiest = max(r["state"]["total"] for r in ranks) if plan.pipe == 1 else None
        assert busiest in (None, pred.memory["state"]), what
        measured = max(r["peak"] for r in ranks)
        # within 25%: on the CPU the tracker does not see FSDP2's gathered parameters (ZeRO-3,
        # predicted as two blocks), and 1D tensor's activation split is modelled per block
        assert abs(pred.memory["total"] / measured - 1) < 0.25, (what, pred.memory, measured)

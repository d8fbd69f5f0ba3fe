"""What a step pays beyond its FLOPs and its bytes: fixed costs per operator, per collective, per
FSDP2 unit, the cost model's terms for small and sharded steps.

A roofline (FLOPs / rate + bytes / bandwidth) is right for large kernels and long messages. A step
of many small kernels, or one whose Plan adds many small collectives and hooks, pays per *call*:
Python, the dispatcher and a kernel launch per operator, a latency per collective, FSDP2's hooks
per unit. A ~1M-parameter GPT of 8 blocks dispatches ~5,000 operators a step (forward, backward
and AdamW's per-tensor loop); ZeRO-3 adds two gathers and a reduce-scatter per block, each with
its hooks and copies, and a DTensor dispatch for every sharded parameter in the optimizer: on this
machine that made ZeRO-3 1.8× slower than data=2 where the roofline had them equal. Each term is a
count (from the model and the Plan, exact) times a cost per call (calibrated on the system):

  term              count per step on the busiest rank                       cost per call
  ops               ops_per_step (traced forward + loss + backward, `spec`)  op_s
                    × micro-batches / stages, + OPTIMIZER_OPS per parameter
                    tensor held (torch's per-tensor AdamW loop on the CPU)
  collective_calls  every collective's calls (the `traffic.comms` list)          collective_s
  fsdp_units        ZeRO-3: FSDP2 units (blocks + root): pre/post forward     fsdp_unit_s
                    and backward hooks, all-gather copy-in/out, reshard, and
                    the optimizer's DTensor dispatch of the unit's parameters

collective_calls is the fixed cost of a call beyond the α-β time `systems.collective_time` already
charges (the latency of its size regime): the wrapper, the ledger, the Python around it.

The costs live in the system file's `[overheads]` table (seconds per call); `exatrain plan
--calibrate` measures them with micro-benchmarks (`calibrate.measure_overheads`) and
`exatrain bench planner` fits them on its calibrated shapes (`fit`). A system without the table
(the shipped GPU systems: there a kernel launch hides behind the previous kernel's work) gets
zero for every term, and `uncalibrated` names them so `exatrain plan` can say so.
"""

from __future__ import annotations

import math

TERMS = ("ops", "collective_calls", "fsdp_units")
COST_KEYS = {"ops": "op_s", "collective_calls": "collective_s", "fsdp_units": "fsdp_unit_s"}
LABELS = {"ops": "operator dispatch (Python + launch per kernel)",
          "collective_calls": "fixed cost per collective call",
          "fsdp_units": "FSDP2 per unit (hooks, gather copy-in/out, reshard)"}
OPTIMIZER_OPS = {"adamw": 12, "adam": 12, "sgd": 3}   # operators per parameter tensor


def counts(spec, plan, options, comm_list, param_tensors: int, pipe_microbatches: int) -> dict:
    """The calls per step of each term on the busiest rank (module doc)."""
    per_stage = spec.ops_per_step / plan.pipe * (pipe_microbatches if plan.pipe > 1 else 1)
    if options.checkpointing == "full":
        per_stage *= 4 / 3   # the recomputed forward
    ops = per_stage + OPTIMIZER_OPS.get(options.optimizer, 12) * param_tensors
    zero3 = plan.shard > 1 and options.zero_stage == 3
    units = math.ceil(len(spec.block_ranges) / plan.pipe) + 1 if zero3 else 0
    return {"ops": ops, "collective_calls": float(sum(c.calls for c in comm_list)),
            "fsdp_units": float(units)}


def seconds(count: dict, system) -> dict:
    """Seconds of each term: count × the system's cost per call (0 where not calibrated)."""
    table = getattr(system, "overheads", {}) or {}
    return {term: count[term] * float(table.get(COST_KEYS[term], 0.0)) for term in TERMS}


def uncalibrated(system) -> list[str]:
    """The terms whose cost per call the system file does not give."""
    table = getattr(system, "overheads", {}) or {}
    return [term for term in TERMS if COST_KEYS[term] not in table]


def nnls(a, b):
    """Non-negative least squares (scipy's Lawson-Hanson)."""
    from scipy.optimize import nnls as _nnls
    return _nnls(a, b)[0]


def fit(rows: list[dict]) -> dict:
    """Fit the costs per call, and a compute factor per compute kind, on measured cases.

    Each row: measured (s), fixed (the model's seconds not fitted: bandwidth part of the
    collectives, bubble, optimizer streaming), compute (the model's compute seconds), kind
    (matmul | conv), counts (`counts`). Solved as non-negative least squares of the relative
    error: measured = fixed + Σ_kind c_kind·compute + Σ_term cost_term·count_term.
    Returns {"compute_factor": {kind: c}, "overheads": {cost key: seconds per call}}."""
    import numpy as np
    kinds = sorted({r["kind"] for r in rows})
    cols = [f"compute:{k}" for k in kinds] + list(TERMS)
    a = np.array([[r["compute"] if c == f"compute:{r['kind']}" else 0.0 for c in cols[:len(kinds)]]
                  + [r["counts"][t] for t in TERMS] for r in rows], dtype=float)
    b = np.array([r["measured"] - r["fixed"] for r in rows], dtype=float)
    w = 1.0 / np.array([r["measured"] for r in rows], dtype=float)   # relative error
    scale = np.maximum(np.abs(a).max(0), 1e-30)                       # conditioning
    x = nnls(a * w[:, None] / scale, b * w) / scale
    return {"compute_factor": {k: float(x[i]) for i, k in enumerate(kinds)},
            "overheads": {COST_KEYS[t]: float(x[len(kinds) + i]) for i, t in enumerate(TERMS)}}

"""`exatrain bench kfac` at tiny sizes: every part runs and writes the figures it promises, and
they are sane (K-FAC's step costs time, its state per rank falls with grad_worker_fraction and
equals the formula, the branches layout equals plain data parallelism).

The command line is parsed by the CLI's own parser; the ranks are the test pool's (started once
per session) instead of fresh processes per run, which would cost ~6 s each on this machine.
Speed is the benchmark's business, not this test's.
"""

from __future__ import annotations

import json

from exatrain.bench import kfac
from exatrain.cli import build_parser
from harness import run_ranks

ARGV = ["bench", "kfac", "--workloads", "cosmoflow", "--optimizers", "kfac,sgd", "--size", "8",
        "--samples", "12", "--steps", "2", "--eval-every", "2", "--batch", "4",
        "--kfac-inverse-every", "1", "--kfac-factor-every", "1", "--seeds", "2",
        "--deepcam-size", "16", "--deepcam-width", "4", "--deepcam-steps", "2", "--warmup", "0"]


def _pool(fn, nproc, args=()):
    return run_ranks(nproc, fn, *args)


def test_bench_kfac_writes_sane_figures():
    args = build_parser(ARGV).parse_args(ARGV)
    result = json.loads(json.dumps(kfac.run(args, launch=_pool)))   # what --json writes
    for o in ("kfac", "sgd"):
        for figure in ("steps_to_target", "seconds_to_target", "step_s", "best_val_mae"):
            assert f"cosmoflow_{o}_{figure}" in result
        assert result[f"cosmoflow_{o}_step_s"] > 0
        assert len(result[f"cosmoflow_{o}_steps_to_target_per_seed"]) == 2
        assert len(result[f"cosmoflow_{o}_curves"]) == 2
    assert result["cosmoflow_kfac_step_overhead"] > 0
    assert result["cosmoflow_kfac_bytes_per_step"] > 0   # the factor all-reduce, every step
    # second-order state: the largest per rank falls from f = 1 to f = 1/2, as the formula says
    small, full = (result[f"second_order_bytes_per_rank_f{f}"] for f in (0.5, 1.0))
    assert 0 < small < full
    for f in (0.5, 1.0):
        assert result[f"second_order_bytes_per_rank_f{f}"] == \
            result[f"second_order_bytes_per_rank_f{f}_formula"]
    # sub-graph part: both layouts near serial, and the branches near the plain data layout
    for layout in ("data", "branches"):
        assert result[f"deepcam_{layout}_step_s"] > 0
        assert 0 < result[f"deepcam_{layout}_max_rel_err_vs_serial"] < 1e-3
        assert 0 <= result[f"deepcam_{layout}_state_rel_norm_err_vs_serial"] < 1e-5
        assert result[f"deepcam_{layout}_worst_state_entry"]
    assert result["deepcam_branch_bytes_per_step"] > 0
    between = ("max_rel_err", "rel_err_in_data_worst_entry", "state_rel_norm_err",
               "output_rel_err_step1")
    for figure in between:
        assert 0 <= result[f"deepcam_branches_vs_data_{figure}"] < 1e-4, figure
    assert result["deepcam_branches_vs_data_rel_err_in_data_worst_entry"] <= \
        result["deepcam_branches_vs_data_max_rel_err"]


def test_median_run_counts_a_run_that_missed_the_target_as_slowest():
    assert kfac._median_reached([(100, 10.0), (None, None), (50, 5.0)]) == (100, 10.0)
    assert kfac._median_reached([(None, None), (300, 1.0), (None, None)]) == (None, None)
    assert kfac._median_reached([(400, 40.0)]) == (400, 40.0)

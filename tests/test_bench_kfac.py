"""`exatrain bench kfac` at tiny sizes: every part runs and writes the figures it promises, and
they are sane (K-FAC's step costs time, its state per rank falls with grad_worker_fraction and
equals the formula, the branches layout equals plain data parallelism).

The command line is parsed by the CLI's own parser; the ranks are the test pool's (started once
per session) instead of fresh processes per run, which would cost ~6 s each on this machine.
Speed is the benchmark's business, not this test's.
"""

from __future__ import annotations

import json

import pytest

from exatrain.bench import kfac
from exatrain.cli import build_parser
from harness import run_ranks

ARGV = ["bench", "kfac", "--workloads", "cosmoflow", "--optimizers", "kfac,adamw,sgd", "--size", "8",
        "--samples", "12", "--steps", "2", "--eval-every", "2", "--batch", "4",
        "--kfac-inverse-every", "1", "--kfac-factor-every", "1", "--seeds", "2",
        "--deepcam-size", "16", "--deepcam-width", "4", "--deepcam-steps", "2", "--warmup", "0"]


def _pool(fn, nproc, args=()):
    return run_ranks(nproc, fn, *args)


def test_bench_kfac_writes_sane_figures():
    args = build_parser(ARGV).parse_args(ARGV)
    result = json.loads(json.dumps(kfac.run(args, launch=_pool)))   # what --json writes
    for o in ("kfac", "adamw", "sgd"):
        for figure in ("steps_to_target", "seconds_to_target", "step_s", "best_val_mae"):
            assert f"cosmoflow_{o}_{figure}" in result
        assert result[f"cosmoflow_{o}_step_s"] > 0
        assert len(result[f"cosmoflow_{o}_steps_to_target_per_seed"]) == 2
        assert len(result[f"cosmoflow_{o}_curves"]) == 2
    # K-FAC did its work: every step preconditioned, a decomposition every step (inverse_every 1);
    # the overhead is a timing, so only its definition is checked here
    assert result["cosmoflow_kfac_preconditioned_steps"] == 2
    assert result["cosmoflow_kfac_decompositions"] == 2
    assert result["cosmoflow_kfac_step_overhead"] > 0
    assert result["cosmoflow_kfac_step_overhead"] == pytest.approx(
        result["cosmoflow_kfac_step_s"] / result["cosmoflow_sgd_step_s"])
    assert 0 < result["cosmoflow_kfac_vs_adamw_p_value"] <= 1
    assert result["cosmoflow_kfac_bytes_per_step"] > 0   # the factor all-reduce, every step
    # second-order state: the largest per rank falls from f = 1 to f = 1/2, as the formula says
    small, full = (result[f"second_order_bytes_per_rank_f{f}"] for f in (0.5, 1.0))
    assert 0 < small < full
    for f in (0.5, 1.0):
        assert result[f"second_order_bytes_per_rank_f{f}"] == \
            result[f"second_order_bytes_per_rank_f{f}_formula"]
    # sub-graph part: both layouts near serial, and the branches near the plain data layout
    # (measured, the same on every run: 1.3e-5 worst entry, 1.8e-8 whole state vs serial;
    # 7.1e-6 worst between the layouts)
    for layout in ("data", "branches"):
        assert result[f"deepcam_{layout}_step_s"] > 0
        assert 0 < result[f"deepcam_{layout}_max_rel_err_vs_serial"] < 5e-5
        assert 0 <= result[f"deepcam_{layout}_state_rel_norm_err_vs_serial"] < 1e-6
        assert result[f"deepcam_{layout}_worst_state_entry"]
    assert result["deepcam_branch_bytes_per_step"] > 0
    between = ("max_rel_err", "rel_err_in_data_worst_entry", "state_rel_norm_err",
               "output_rel_err_step1")
    for figure in between:
        assert 0 <= result[f"deepcam_branches_vs_data_{figure}"] < 3e-5, figure
    assert result["deepcam_branches_vs_data_rel_err_in_data_worst_entry"] <= \
        result["deepcam_branches_vs_data_max_rel_err"]


def test_median_run_counts_a_run_that_missed_the_target_as_slowest():
    assert kfac._median_reached([(100, 10.0), (None, None), (50, 5.0)]) == (100, 10.0)
    assert kfac._median_reached([(None, None), (300, 1.0), (None, None)]) == (None, None)
    assert kfac._median_reached([(400, 40.0)]) == (400, 40.0)


def test_rank_sum_p_value_of_separated_tied_and_unreached_runs():
    # 3 against 3, fully apart: 2 of the C(6, 3) = 20 splits are as extreme (either side)
    assert kfac.rank_sum_p_value([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == 0.1
    assert kfac.rank_sum_p_value([6.0, 5.0, 4.0], [1.0, 2.0, 3.0]) == 0.1
    # runs that never reached the target rank above all that did, tied among themselves
    assert kfac.rank_sum_p_value([None, None, None], [7.0, 8.0, 9.0]) == 0.1
    # the same values on both sides: no split is less extreme
    assert kfac.rank_sum_p_value([350, 400], [400, 350]) == 1.0
    # 4 against 4 with one cross-over: rank sum 11 of mean 18; of the C(8, 4) = 70 splits,
    # {1,2,3,4} and {1,2,3,5} lie as far out below, {5,6,7,8} and {4,6,7,8} above
    assert abs(kfac.rank_sum_p_value([1, 2, 3, 5], [4, 6, 7, 8]) - 4 / 70) < 1e-12


def test_rank_sum_p_value_of_many_seeds_by_the_normal_approximation():
    # C(60, 30) splits cannot be counted: the normal approximation, at once
    a, b = list(range(30)), list(range(100, 130))
    assert kfac.rank_sum_p_value(a, b) < 1e-9
    assert kfac.rank_sum_p_value(a + b, b + a) == 1.0
    # near the switch-over the approximation follows the exact count: 10 against 10 (184,756
    # splits, exact) and the same samples read by the approximation agree to 0.01
    x = [41.7, 66.2, 70.6, 50.6, 50.7, 86.3, 107.0, 80.6, 69.8, 55.0]
    y = [124.6, 44.9, 74.4, 44.2, 76.7, 44.5, 48.9, 71.2, 61.0, 90.0]
    exact = kfac.rank_sum_p_value(x, y)
    approximate = kfac.rank_sum_p_value(x, y, exact_splits=0)
    assert exact != approximate and abs(exact - approximate) < 0.01, (exact, approximate)


def test_bench_without_arguments_runs_the_config_defaults_beside_a_tuned_adamw(tmp_path):
    """What a user gets: K-FAC and AdamW exactly at the config's defaults (only the name
    differs), the tuned AdamW at its own lr, 3 seeds, the default job's steps, stopped at the
    target."""
    from exatrain.train.config import load_config

    argv = ["bench", "kfac"]
    args = build_parser(argv).parse_args(argv)
    assert (args.seeds, args.optimizers, args.stop_at_target) == (3, "kfac,adamw,adamw_tuned", True)
    default = load_config(None).optim
    for optimizer, name, lr in (("kfac", "kfac", default.lr), ("adamw", "adamw", default.lr),
                                ("adamw_tuned", "adamw", args.lr_adamw_tuned)):
        optim = kfac._config(tmp_path, "cosmoflow", optimizer, args, 2000, 32).optim
        assert vars(optim) == {**vars(default), "name": name, "lr": lr}, optimizer
    given = build_parser(argv).parse_args(argv + ["--kfac-damping", "0.1", "--lr-kfac", "0.02"])
    optim = kfac._config(tmp_path, "cosmoflow", "kfac", given, 2000, 32).optim
    assert (optim.kfac_damping, optim.lr, optim.kfac_inverse) == (0.1, 0.02, default.kfac_inverse)

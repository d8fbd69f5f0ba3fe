"""The full 3D grid (2,2,2) and the 4D hybrid data=2 × (2,1,2): correctness on 8 ranks, one launch.

Layers: 1D/3D Linear equality, the byte formula and the full-weight round trip on (2,2,2) (the
checks of test_tensor_layers.py, batch 5: ragged over z). Training: GPT under (2,2,2) and under
data=2 × (2,1,2) with a ragged z-split, three Trainer steps against serial (SGD, relative 1e-5);
the ViT runs the same code paths on 4 ranks in test_tensor_training.py.
"""

from __future__ import annotations

import pytest

from harness import run_ranks
from test_tensor_layers import TOL, layers_on_grids
from test_tensor_training import check, serial, train_plans

CASES_8 = [
    (dict(tensor=(2, 2, 2)), "gpt", "sgd", 8, ()),
    (dict(data=2, tensor=(2, 1, 2)), "gpt", "sgd", 6, ()),  # 3 per replica: ragged over z
]


def grid8(cases) -> dict:
    return {"layers": layers_on_grids([dict(tensor=(2, 2, 2))], batches=(5,)),
            "train": train_plans(cases)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(8, grid8, CASES_8)


def test_layers_on_the_cube(results):
    for per_rank in results:
        (r,) = per_rank["layers"].values()
        worst = max(r["errs"], key=r["errs"].get)
        assert r["errs"][worst] <= TOL, (worst, r["errs"][worst])
        assert r["counted"] == r["formula"]
        assert r["exact_round_trip"]
        assert set(r["counted"]) == {"tensor", "tensor_x", "tensor_y", "tensor_z"}


def test_cube_and_4d_train_like_serial(results):
    references = {case[1:]: serial(*case[1:]) for case in CASES_8}
    for rank, per_rank in enumerate(results):
        for case, result in zip(CASES_8, per_rank["train"]):
            check(result, references[case[1:]], 1e-5, 1e-7, (rank, case))

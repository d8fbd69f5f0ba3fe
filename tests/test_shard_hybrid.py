"""Hybrid sharding (data × shard), SGD at 1e-5, and mixed precision through the sharded paths.

Same method and tolerances as test_shard.py (whose helpers this file uses): one 4-rank launch runs
every variant, each compared with the same model trained serially. Mixed precision (bf16 through
FSDP2's mixed-precision policy with fp32 norm units; fp16 with loss scaling through ZeRO-2) is
held to 2e-3 against the same precision run serially and 1e-2 against fp32 (losses), and its
weights to 3e-4 (bf16) and 3e-5 (fp16) against the same precision serially (`check_variants`).
"""

from __future__ import annotations

import math

from test_shard import HYBRID_VARIANTS, check_variants


def test_hybrid_sgd_and_mixed_precision_equal_serial(corpus, tmp_path):
    # Fresh rank processes: after the suite's other 4-rank tests in the same processes, a gathered
    # FSDP2 state could meet a DeviceMesh from a closed process group ("Could not resolve the
    # process group registered under the name ..."): torch caches by mesh layout. Mesh.close clears
    # DTensor's caches, which did not cure it here; the cause is not found yet.
    ranks = check_variants(corpus, tmp_path, HYBRID_VARIANTS, fresh=True)["ranks"]
    # hybrid: the reduced shard is all-reduced over data, through the ledger
    assert ranks[0]["hybrid_zero3"]["grad_bytes"]["data"] > 0
    assert ranks[0]["hybrid_zero1"]["grad_bytes"]["data+shard"] > 0
    assert ranks[0]["fp16_zero2"]["summary"]["loss_scale"] == 2.0 ** 16
    assert math.isfinite(ranks[0]["bf16_zero3"]["summary"]["val_loss"])

"""Start-up that scales: `import exatrain` opens few files beyond `import torch`'s own.

Measured in a fresh interpreter with an audit hook (observe.startup). On 2026-11-24, before the
heavy imports were made lazy, `import exatrain` opened 1,168 files beyond torch's (sympy, mpmath,
DTensor, torch._dynamo through torch.distributed.pipelining and torch.distributed.checkpoint);
after, ~240. A new eager import of a heavy module fails here: import it where it is used.
"""

from __future__ import annotations

from exatrain.observe.startup import measure_import, summarise

CEILING_BEYOND_TORCH = 300   # opens; measured 237 on 2026-11-25 (the target: <= 1168 / 3 = 389)


def test_import_exatrain_opens_few_files_beyond_torch():
    figures = summarise(measure_import())
    assert figures["heavy_modules_at_import"] == "none", (
        f"import exatrain now imports {figures['heavy_modules_at_import']}: import it where it "
        "is used (see docs/how-to/startup.md)")
    assert figures["exatrain_opens_beyond_torch"] <= CEILING_BEYOND_TORCH, (
        f"import exatrain opens {figures['exatrain_opens_beyond_torch']} files beyond torch's "
        f"(ceiling {CEILING_BEYOND_TORCH}): a new eager import? `python -X importtime -c "
        f"'import exatrain'` shows which")

"""What a block is, without knowing the model: the unit that activation checkpointing wraps,
compile compiles one at a time and FSDP2 shards (`find_blocks`).

  * every child of every outermost `nn.ModuleList` (a transformer's `blocks`, a U-Net's branches);
  * in a model without a `ModuleList`, each direct child of the root that holds parameters
    (e.g. CosmoFlow's `features` and `head`).
"""

from __future__ import annotations

from torch import nn


def find_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, block) for every block of `model`, in registration order (see the module doc)."""
    found: list[tuple[nn.Module, str, nn.Module]] = []

    def visit(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, nn.ModuleList):
                found.extend((child, n, c) for n, c in child.named_children())
            else:
                visit(child)

    visit(model)
    if not found:
        found = [(model, n, c) for n, c in model.named_children()
                 if any(True for _ in c.parameters())]
    return found

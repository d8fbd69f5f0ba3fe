"""Model transfer between trainers: point-to-point between corresponding ranks.

Two trainers run the same intra-trainer Plan, so rank c of one holds exactly the pieces of the
model that rank c of the other holds: the full parameters under data parallelism and ZeRO-1/2,
its dim-0 chunk under ZeRO-3 (FSDP2 DTensors), its block of every split weight under tensor
parallelism, the full (replicated) weights under spatial parallelism, its stage's layers under
pipe. A transfer therefore sends
each rank's local tensors, in the model's parameter order, to the rank at the same position of the
other trainer: the `trainer` axis of the mesh (`TrainerMesh.trainer_axis`, position = trainer id).
No rank gathers or scatters anything, whatever the layout.

What moves: parameters and buffers (`model_tensors`), and with `population.exchange_optimizer`
the optimizer state of every stepped tensor (Adam's step, moments) in a fixed key order.

Communication (one batched isend/irecv per transfer, recorded on the `trainer` axis, tag
"exchange"): a trainer sending its model sends, summed over its ranks, its local state bytes:

    bytes per transfer = Σ over the trainer's ranks of the local parameter + buffer bytes
                         (+ optimizer state bytes with exchange_optimizer)

which for one-rank trainers (or any layout that splits rather than replicates) is the model size
(4 bytes × parameters in fp32); replicated layouts (data > 1) send one copy per replica, each
rank to its counterpart, which keeps every transfer local to a pair of ranks.
"""

from __future__ import annotations

import torch

from ..comm import Axis, exchange, nbytes
from ..comm.dtensor import local_tensor


def model_tensors(model: torch.nn.Module, optimizer=None) -> list[torch.Tensor]:
    """This rank's tensors that define the model (and the optimizer's state), in a fixed order."""
    tensors = [local_tensor(p.detach()) for p in model.parameters()]
    tensors += [local_tensor(b) for b in model.buffers()]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                tensors += [local_tensor(state[k]) for k in sorted(state)
                            if isinstance(state[k], torch.Tensor)]
    return tensors


def state_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(nbytes(t) for t in tensors)


def transfer(tensors: list[torch.Tensor], axis: Axis, send_to: list[int],
             recv_from: int | None, tag: str = "exchange") -> list[torch.Tensor] | None:
    """Send `tensors` to the trainers `send_to` and receive the same shapes from `recv_from`.

    Returns the received copies (or None); every rank of every trainer involved calls it with
    matching arguments, so each send meets its receive.
    """
    sends = [(t.contiguous(), peer) for peer in send_to for t in tensors]
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors] \
        if recv_from is not None else None
    recvs = [(r, recv_from) for r in received] if received is not None else []
    for request in exchange(sends, recvs, axis, tag=tag):
        request.wait()
    return received


@torch.no_grad()
def load(tensors: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Overwrite the model's (and optimizer's) tensors in place with `values`."""
    for t, v in zip(tensors, values, strict=True):
        t.copy_(v)

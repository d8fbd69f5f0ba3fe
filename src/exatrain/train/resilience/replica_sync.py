"""Replica groups on slow links: synchronise every H optimizer steps, not every step (torchft's
LocalSGD and DiLoCo).

`[fault_tolerance] sync = "local_sgd" | "diloco"` with `sync_every = H`: each replica group
trains on its own slices of every global batch with its own optimizer (the inner steps); only
the axes inside a group (in-group `data`, `shard`, `space`, `tensor`) communicate per step.
Every H inner steps the groups synchronise through the torchft Manager:

    local_sgd   the parameters are averaged over the groups taking part (Lin et al. 2018,
                arXiv:1805.09767).
    diloco      each group's change since the last synchronisation, the pseudo-gradient
                Δ_k = θ_global − θ_k, is averaged over the groups; an outer SGD with Nesterov
                momentum (`outer_lr`, `outer_momentum`; the DiLoCo paper's 0.7 and 0.9, Douillard
                et al. 2023, arXiv:2311.08105) steps θ_global with it, and every group goes on
                from the new θ_global. torch.optim.SGD's Nesterov update, per element:
                    b ← μ·b + Δ̄   (b = Δ̄ at the first synchronisation)
                    θ_global ← θ_global − η·(Δ̄ + μ·b)

Only parameters are synchronised: buffers (BatchNorm's running statistics) stay each group's
own, so evaluation in different groups may differ slightly.

Both are torchft's own (`torchft.local_sgd.LocalSGD`, `DiLoCo` with one fragment): they hook the
inner optimizer's `step` (a post-step hook counts the steps and synchronises on the H-th), which
is where exatrain's step ends, whichever kernel steps (a step skipped on the device by
`found_inf` still counts as an inner step; a step skipped on the host does not). The Manager runs
its quorum synchronously (`use_async_quorum=False`, which DiLoCo requires): one quorum per
synchronisation, not per step.

Communication, per in-group rank, every H steps: one quorum and one commit RPC (a few hundred
bytes, one host synchronisation) and an all-reduce of 4·P bytes (P: this rank's parameter
elements, fp32; full parameters under in-group DDP, local shards under FSDP2) with the same
in-group rank of every other group, one tensor per parameter (a ring sends 2·4·P·(G−1)/G
bytes for G groups). Per step that is 4·P/H, against sync = "step"'s 4·P every step. DiLoCo also
keeps a copy of θ_global (4·P bytes, in host memory) and the outer momentum (4·P bytes).

Failures and heals (torchft's semantics):
* A group that dies: the others' next synchronisation fails (a closed connection, or
  `timeout_s` for a hung group) and is not committed: under local_sgd each group keeps its own
  parameters, under diloco each goes back to the last θ_global (the H inner steps since are
  lost), and the synchronisation after that forms a quorum without the dead group. Between
  synchronisations nothing waits for it.
* A restarted group heals at the next synchronisation, in the quorum: it receives a live
  group's model, inner optimizer, step (and under diloco θ_global and the outer momentum) and
  takes part in that synchronisation with them, so from then on it equals the others. Its inner
  steps since it started are discarded; `ReplicaGroups.take_heal` moves its step number on.
* The groups meet at a synchronisation only if the lighthouse waits for a live group that has
  not asked yet (`launch.lighthouse.join_timeout_ms`: half of quorum_timeout_s, so a synchronisation
  period must be shorter). With the per-step window (heartbeat_timeout_ms) a restarted group
  and a survivor whose synchronisations fell out of phase each went on alone, measured.
* A missing group's samples are not trained on by anyone (`fault_tolerance.batch` applies to
  sync = "step" only).
"""

from __future__ import annotations

import torch


class PeriodicSync:
    """One replica group's LocalSGD or DiLoCo: torchft's context manager over the model and the
    inner optimizer, entered on construction and left by `close`."""

    def __init__(self, options, manager, model, optimizer, device: torch.device):
        """`options`: config.fault_tolerance; `manager`: a torchft Manager made with
        use_async_quorum=False; `model`: the unwrapped model (its parameters are synchronised);
        `optimizer`: the inner optimizer, whose steps are counted."""
        from torchft.local_sgd import DiLoCo, LocalSGD
        self.mode, self.every, self.manager = options.sync, options.sync_every, manager
        if options.sync == "local_sgd":
            self._algorithm = LocalSGD(manager, model, optimizer, sync_every=options.sync_every)
        else:
            momentum = options.outer_momentum
            # the outer optimizer steps the global parameters with the averaged pseudo-gradient
            self.outer = torch.optim.SGD(model.parameters(), lr=options.outer_lr,
                                         momentum=momentum, nesterov=momentum > 0)
            self._algorithm = DiLoCo(manager, [model], optimizer, self.outer,
                                     sync_every=options.sync_every,
                                     backup_device=torch.device("cpu"),
                                     pin_memory=device.type == "cuda")
        self._algorithm.__enter__()
        self.syncs = 0

    def close(self) -> None:
        """Remove the optimizer hooks; count the synchronisations committed."""
        if self._algorithm is not None:
            self.syncs = self.manager.current_step()
            self._algorithm.__exit__(None, None, None)
            self._algorithm = None

    def figures(self) -> dict:
        return {"ft_sync": self.mode, "ft_sync_every": self.every, "ft_syncs": self.syncs}

"""Replica groups: data parallelism across groups that survive the loss of a group (torchft).

With `[fault_tolerance] enabled = true` the job's `plan.data` replicas are split into `groups`
replica groups. Each group is a torch.distributed world of its own (its own rendezvous, its own
mesh of every other axis, `plan.data / groups` data replicas inside it); the groups share no
process group, so a dead rank poisons only its own group. Across groups the gradients are
averaged through torchft's `Manager`, whose process group is rebuilt whenever the set of live
groups (the quorum, kept by torchft's lighthouse) changes.

Each optimizer step (`train.step.TrainStep` calls these, in this order):

    begin_step()        manager.start_quorum(): the quorum RPC, and a restarted group's heal,
                        run in torchft's thread while the forward pass runs
    adopted_micro_batches()  keep: the missing groups' micro-batches this rank also runs
    reduce_gradients()  one flat copy of the gradients of the tensors the optimizer steps,
                        manager.allreduce (AVG over the groups taking part), copied back
    should_commit()     every group's verdict; False (a group died inside the step) and the
                        step is discarded: no optimizer step, and the same micro-batches run again

Communication per step, per in-group rank: one all-reduce of 4·P bytes (P: the optimizer's
elements on this rank; full parameters under in-group DDP, shards under ZeRO) with the same
in-group rank of every other group, in one flat buffer (a ring: 2·4·P·(G-1)/G sent), plus the
quorum and commit RPCs (a few hundred bytes, one host synchronization).

Healing: a group that starts while others are training (a restart after a failure) is behind;
torchft fetches the state from the same in-group rank of a live group (HTTP) on its first
quorum: the model's state, the optimizer's, and the trainer's step, applied inside
`should_commit`. That first step the group does not take part in the average (its gradient is
zeroed) but it applies the average, so from then on its weights equal the others'. No checkpoint
is read. `healed_to` tells the loop which step it is at now.

Batch while a group is out: each group reads its own slices of every global batch
(`sample_axis`), as the uninterrupted run's replicas do. `batch = "keep"` (the default): the
groups present also run the missing groups' slices, as extra micro-batches read on the training
thread (`adopted_micro_batches`; one 4·G-byte all-reduce per step says who is present), and the
gradient is the sum over the groups divided by G: the uninterrupted run's gradient up to the
order of the sums (dropout masks aside), at the cost of slower steps meanwhile. `batch =
"shrink"`: the gradient is the mean over the groups present, so the step's batch shrinks by the
missing groups' share.

Groups on slow links (`sync = "local_sgd" | "diloco"`): no per-step calls at all; the groups
synchronise every `sync_every` optimizer steps instead (`replica_sync.PeriodicSync`, made in
`start`), and `take_heal` still says when a heal moved the step on.

torchft is imported only here, and only when `[fault_tolerance]` is on (`pip install
exatrain[ft]`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import ReduceOp

from ...comm import broadcast_object
from ...errors import UserError
from ...launch.lighthouse import join_timeout_ms
from ...parallel.data import unwrap

GROUP_ENV = "REPLICA_GROUP_ID"          # which replica group this process belongs to (0-based)
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # the lighthouse's address, as torchft names it
MAX_DISCARDED_IN_A_ROW = 20  # attempts of one step before the group gives up (and fails)


class ReplicaGroupError(UserError, RuntimeError):
    """A replica group cannot join or go on (no lighthouse, no group id, torchft missing, a step
    that never commits).

    What to do: start the groups as the fault-tolerance section of the long-run tutorial shows
    (REPLICA_GROUP_ID and TORCHFT_LIGHTHOUSE in each group's environment), or turn
    `fault_tolerance.enabled` off.
    """


def group_count(config) -> int:
    """The number of replica groups ([fault_tolerance] groups; 0 = plan.data)."""
    return config.fault_tolerance.groups or config.plan.data


def group_plan_options(config):
    """config.plan for one group: `data / groups` data replicas (0 stays 0: whatever the
    group's ranks leave after the other axes)."""
    data = config.plan.data // group_count(config) if config.plan.data else 0
    return dataclasses.replace(config.plan, data=data)


def start_lighthouse(config, min_replicas: int | None = None):
    """A torchft lighthouse in this process for the groups of `config`: (address, stop).
    `min_replicas` (default fault_tolerance.min_replicas): groups needed for a quorum."""
    from torchft.coordination import LighthouseServer
    f = config.fault_tolerance
    server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas or f.min_replicas,
                              join_timeout_ms=join_timeout_ms(f),
                              heartbeat_timeout_ms=f.heartbeat_timeout_ms)
    return server.address(), server.shutdown


@dataclass(frozen=True)
class SampleAxis:
    """This rank's place among all the job's data replicas (every group's): which slice of
    each global batch it reads."""
    rank: int
    size: int


def _heal_state(model, optimizer, scaler, nonfinite_skips, schedule, current_step):
    """(save, load) of what a restarted group receives from a live one: the model's state
    (copied: buffers change in the forward running beside the send), the optimizer's, the
    loss scaler's, the non-finite count and the step about to run. `load` applies it in place
    before the group's first optimizer step, which then applies the groups' average at the
    peer's step's learning rate."""
    def save() -> dict:
        return {"model": {k: v.detach().clone() for k, v in unwrap(model).state_dict().items()},
                "optimizer": optimizer.state_dict(), "step": current_step(),
                "loss_scaler": scaler.state_dict(), "nonfinite_skipped": nonfinite_skips.skipped}

    def load(state: dict) -> None:
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scaler.enabled:
            scaler.load_state_dict(state["loss_scaler"])
        nonfinite_skips.skipped = int(state["nonfinite_skipped"])
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr(int(state["step"]))

    return save, load


class ReplicaGroups:
    """This rank's side of the replica axis: the torchft Manager and the step's three calls."""

    def __init__(self, config, mesh, data_axis):
        f = config.fault_tolerance
        self.options, self.mesh = f, mesh
        self.groups = group_count(config)
        raw = os.environ.get(GROUP_ENV)
        if raw is None or not raw.isdigit() or int(raw) >= self.groups:
            raise ReplicaGroupError(
                f"rank {mesh.rank}: [fault_tolerance] needs {GROUP_ENV} = 0..{self.groups - 1} "
                f"(this process's replica group), got {raw!r}. Start each group with its own "
                f"{GROUP_ENV}, or set fault_tolerance.enabled = false.")
        self.group = int(raw)
        self.lighthouse = f.lighthouse if f.lighthouse != "auto" else os.environ.get(LIGHTHOUSE_ENV)
        if not self.lighthouse:
            raise ReplicaGroupError(
                f"rank {mesh.rank}: fault_tolerance.lighthouse = \"auto\" but {LIGHTHOUSE_ENV} is "
                "not set: start a lighthouse (`torchft_lighthouse --min_replicas "
                f"{f.min_replicas} --bind [::]:29510`) and export {LIGHTHOUSE_ENV}="
                "http://HOST:29510, or name it in fault_tolerance.lighthouse; or let `exatrain "
                f"run --nproc N` (without {GROUP_ENV}) start the lighthouse and every group.")
        # the job's replicas: group k's data replica r is replica k·(data per group) + r
        self.sample_axis = SampleAxis(self.group * data_axis.size + data_axis.rank,
                                      self.groups * data_axis.size)
        self.seed_rank = self.group * mesh.world_size + mesh.rank  # dropout: the job's rank
        self.manager = None
        # sync = "step": the step's calls below; else every sync_every steps (replica_sync)
        self.per_step = f.sync == "step"
        self.periodic = None
        self.healed_to: int | None = None  # set by a heal, taken by the loop (take_heal)
        self.heals: list[dict] = []
        self.discarded = 0                 # attempts not committed (a group died inside)
        self._in_a_row = 0
        self._commit_times: list[float] = []
        self._steps_alone = 0              # committed steps with fewer groups than `groups`

    # ------------------------------------------------------------------ joining
    def start(self, model, optimizer, scaler, nonfinite_skips, schedule, current_step,
              sampling, decode) -> None:
        """Collective over the group: make the Manager (last, just before the first step: a
        group heartbeating to the lighthouse is waited for). Then what a peer's heal sends and
        sets: the Trainer's model, optimizer, loss scaler, non-finite count, schedule
        (`lr(step)`) and `current_step()` (0-based: the step about to run); and where a
        missing group's samples come from (batch = "keep"): the Trainer's `sampling` and the
        device `decode`."""
        self._sampling, self._decode = sampling, decode
        try:
            from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        except ImportError as exc:
            raise ReplicaGroupError(
                f"[fault_tolerance] needs torchft ({exc}); install it with "
                "`pip install 'exatrain[ft]'`, or set fault_tolerance.enabled = false.") from None
        f, mesh = self.options, self.mesh
        timeout = timedelta(seconds=f.timeout_s)
        # the Manager's own store (its keys beside the group's); group rank 0 serves it
        store = None
        if mesh.rank == 0:
            host = os.environ.get("MASTER_ADDR") or socket.gethostname()
            store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            where = (host, store.port)
        else:
            where = None
        host, port = broadcast_object(where, mesh.world)
        self._store = store  # held: the server lives as long as the Manager
        pg = ProcessGroupNCCL(timeout=timeout) if mesh.device.type == "cuda" \
            else ProcessGroupGloo(timeout=timeout)
        save, self._load = _heal_state(model, optimizer, scaler, nonfinite_skips, schedule,
                                       current_step)
        try:
            self.manager = Manager(
                pg=pg, load_state_dict=None, state_dict=None, min_replica_size=f.min_replicas,
                timeout=timeout, quorum_timeout=timedelta(seconds=f.quorum_timeout_s),
                connect_timeout=timeout, rank=mesh.rank, world_size=mesh.world_size,
                store_addr=host, store_port=port, lighthouse_addr=self.lighthouse,
                # torchft numbers the groups by the id's trailing digits
                replica_id=f"exatrain_group_{self.group}",
                # every group starts from the same seeded weights: no sync at step 0 (torchft's
                # would heal all but one group there, leaving their step-1 gradients out)
                init_sync=False,
                # per step: the quorum runs beside the forward; DiLoCo needs it synchronous
                # (and LocalSGD heals then before its average, so the healed group takes part)
                use_async_quorum=self.per_step)
        except RuntimeError as exc:
            raise ReplicaGroupError(
                f"rank {mesh.rank} of replica group {self.group}: the torchft Manager could not "
                f"start ({exc}). Is the lighthouse at {self.lighthouse} running?") from exc
        self.manager.register_state_dict_fn("exatrain", self._apply_heal, save)
        resumed = current_step()
        if resumed:  # from a checkpoint: torchft counts commits from there, so that a group
            # that resumed from an older checkpoint than the others is behind them, and heals
            commits = resumed if self.per_step else resumed // f.sync_every
            self.manager.load_state_dict({"step": commits,
                                          "batches_committed": commits * self.groups})
        if not self.per_step:
            from .replica_sync import PeriodicSync
            self.periodic = PeriodicSync(f, self.manager, unwrap(model), optimizer, mesh.device)

    def _apply_heal(self, state) -> None:
        """A live peer's state, applied inside should_commit on a group that was behind."""
        self._load(state)
        self.healed_to = int(state["step"])
        # the step (numbered as metrics.jsonl numbers them) this group takes part in again
        self.heals.append({"group": self.group, "rejoined_at_step": self.healed_to + 1,
                           "at": time.time()})

    # ------------------------------------------------------------------ the step
    def begin_step(self) -> None:
        self.manager.start_quorum()

    def adopted_micro_batches(self, step: int) -> list:
        """batch = "keep": the micro-batches of step `step` (0-based) that this rank covers for
        the groups not taking part in it (dead, or healing). Which groups take part comes from
        a one-hot per group, summed over the groups (a healing group's is zeroed by torchft):
        missing group m falls to the (i mod alive)-th live group, i its place among the
        missing, and to the same in-group data replica, so every in-group rank covers as many
        micro-batches as its peers. "shrink": none."""
        if self.options.batch != "keep":
            return []
        one_hot = torch.zeros(self.groups, device=self.mesh.device)
        one_hot[self.group] = 1
        self.manager.allreduce(one_hot, reduce_op=ReduceOp.SUM).wait()
        present = one_hot.cpu()  # (a host read: the quorum is known by now anyway)
        alive = [g for g in range(self.groups) if present[g] > 0]
        missing = [g for g in range(self.groups) if present[g] == 0]
        mine = [m for i, m in enumerate(missing) if alive and alive[i % len(alive)] == self.group]
        per_group = self.sample_axis.size // self.groups
        in_group = self.sample_axis.rank % per_group
        return [batch for m in mine
                for batch in self._read_slice(step, m * per_group + in_group)]

    def own_micro_batches(self, step: int) -> list:
        """This rank's own micro-batches of step `step` (0-based): a heal that lands in a
        discarded attempt moves the retry to the peer's step."""
        return self._read_slice(step, self.sample_axis.rank)

    def _read_slice(self, step: int, position: int) -> list:
        """Replica `position`'s micro-batches of step `step`, read here on the training thread
        (only while a group is out), on the device and decoded."""
        from ...data.batches import collate
        from ...parallel.nested import map_tensors
        sampling = self._sampling
        indices = sampling.slice_indices(step, position)
        out = []
        for start in range(0, len(indices), sampling.micro):
            x, y = (sampling.collate_fn or collate)(
                [sampling.train_set[i] for i in indices[start:start + sampling.micro]])
            x, y = map_tensors(x, lambda t: t.to(self.mesh.device)), y.to(self.mesh.device)
            out.append((self._decode(x) if self._decode is not None else x, y))
        return out

    def reduce_gradients(self, params) -> None:
        """Average the gradients of `params` (the tensors the optimizer steps, in the same order
        in every group) over the groups: one flat buffer, one all-reduce. keep: the sum of each
        group's gradient over the number of groups (the groups present cover the others'
        samples); shrink: the mean over the groups taking part."""
        grads = []
        for p in params:
            g = p.grad
            if g is None:  # the same buffer size in every group: a missing gradient is zeros
                g = p.grad = torch.zeros_like(p)
            grads.append(g.to_local() if hasattr(g, "to_local") else g)
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.options.batch == "keep":
            flat.div_(self.groups)
            work = self.manager.allreduce(flat, reduce_op=ReduceOp.SUM)
        else:
            work = self.manager.allreduce(flat)  # AVG over the groups taking part
        work.wait()  # errors are kept by torchft: the commit then says no
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def should_commit(self) -> bool:
        """Every group's verdict on this attempt (applies a pending heal first)."""
        committed = self.manager.should_commit()
        if not committed:
            self.discarded += 1
            self._in_a_row += 1
            if self._in_a_row >= MAX_DISCARDED_IN_A_ROW:
                raise ReplicaGroupError(
                    f"rank {self.mesh.rank} of replica group {self.group}: {self._in_a_row} "
                    "attempts of one step in a row were not committed; the groups cannot agree "
                    f"(is the lighthouse at {self.lighthouse} alive?).")
            return False
        self._in_a_row = 0
        self._commit_times.append(time.perf_counter())
        if self.manager.num_participants() < self.groups:
            self._steps_alone += 1
        return True

    def take_heal(self) -> int | None:
        """The step this group healed to in the last step (None if it did not heal)."""
        healed, self.healed_to = self.healed_to, None
        return healed

    # ------------------------------------------------------------------ the end
    def figures(self) -> dict:
        """The summary's figures: attempts discarded, the longest pause between committed steps
        beyond the median step, heals, steps committed with groups missing."""
        gaps = [b - a for a, b in zip(self._commit_times, self._commit_times[1:])]
        pause = max(gaps) - statistics.median(gaps) if gaps else 0.0
        if self.periodic:  # (no per-step commits to count: the synchronisations instead)
            return {"ft_groups": self.groups, "ft_group": self.group, "ft_heals": self.heals,
                    **self.periodic.figures()}
        return {"ft_groups": self.groups, "ft_group": self.group,
                "ft_discarded_attempts": self.discarded, "ft_pause_s_max": pause,
                "ft_heals": self.heals, "ft_steps_with_groups_missing": self._steps_alone,
                "ft_batch": self.options.batch}

    def close(self) -> None:
        if self.periodic is not None:
            self.periodic.close()
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

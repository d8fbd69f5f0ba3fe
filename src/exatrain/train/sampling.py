"""Which samples each step of a rank trains on, and the loader that delivers them.

Global shuffle: epoch e permutes all samples with the seed (seed, e); step s's global batch is
perm[s·B : (s+1)·B] and data replica r takes its r-th slice. Node shuffle (`data.shuffle =
"node"`): the samples are split into one contiguous shard per node, each node permutes only its
shard (seed (seed, e, node)), and the node's replicas take consecutive slices of it, so a node reads
each sample of its shard once per epoch and no other (staging copies only that shard). Nodes are
told apart by host name (`data.stage.host_name`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..comm import all_gather_object
from ..data.loader import EpochSampler, Prefetcher, run_loader
from ..parallel.layout import channels_last_input, input_memory_format
from .config import ConfigError


@dataclass(frozen=True)
class NodeShard:
    """data.shuffle = "node": this node's part of the training set and this replica's place."""
    node: int                # this node's index (nodes in rank order)
    indices: np.ndarray      # the node's shard of sample indices
    position: int            # this replica's position among the node's replicas
    replicas_on_node: int
    nodes: int


def node_shard(config, mesh, data_axis, samples: int) -> NodeShard | None:
    """Collective: this node's shard under data.shuffle = "node"; None for the global shuffle."""
    if getattr(config.data, "shuffle", "global") != "node":
        return None
    from ..data.stage import host_name
    replicas_total = data_axis.size
    every = all_gather_object((host_name(), data_axis.rank), mesh.world)
    hosts = list(dict.fromkeys(h for h, _ in every))  # in rank order
    replicas = {h: sorted({r for hh, r in every if hh == h}) for h in hosts}
    split = [r for r in range(replicas_total) if sum(r in v for v in replicas.values()) > 1]
    counts = {len(v) for v in replicas.values()}
    if split or len(counts) > 1:
        raise ConfigError(
            "data.shuffle = \"node\" needs every data replica's ranks on one node and the "
            f"same number of replicas on every node; replicas per node here: "
            f"{ {h: v for h, v in replicas.items()} }. Use data.shuffle = \"global\", or "
            "launch so each node holds whole replicas (pipe/space/tensor innermost).")
    me = hosts.index(host_name())
    shard = np.array_split(np.arange(samples), len(hosts))[me]
    on_node = len(replicas[host_name()])
    if len(shard) < on_node * (config.train.batch_size // replicas_total):
        raise ConfigError(f"data.shuffle = \"node\": a node's shard of {len(shard)} samples "
                          "is smaller than its part of one batch; lower train.batch_size.")
    return NodeShard(me, shard, replicas[host_name()].index(data_axis.rank), on_node, len(hosts))


class Sampling:
    """This rank's sample order and its micro-batches on the device, epoch after epoch."""

    def __init__(self, config, mesh, data_axis, train_set, micro: int, num_workers: int,
                 collate_fn=None):
        self.config, self.mesh, self.data_axis = config, mesh, data_axis
        self.collate_fn = collate_fn   # a user's (workloads.user.Task), or None: the loader's
        self.train_set, self.micro, self.num_workers = train_set, micro, num_workers
        t, n = config.train, len(train_set)
        self.node_shard = node_shard(config, mesh, data_axis, n)
        self.steps_per_epoch = n // t.batch_size
        if self.node_shard is not None:  # the smallest shard sets every node's steps
            s = self.node_shard
            self.steps_per_epoch = (n // s.nodes) // (
                s.replicas_on_node * (t.batch_size // data_axis.size))
        if self.steps_per_epoch == 0:
            raise ConfigError(f"train.batch_size={t.batch_size} is larger than the training set "
                              f"({n} samples); lower it or add samples.")

    def rank_indices(self, epoch: int, first_step: int) -> list[int]:
        """This replica's sample indices for steps first_step.. of `epoch`, in order."""
        batch_size, seed = self.config.train.batch_size, self.config.run.seed
        per_replica = batch_size // self.data_axis.size
        s = self.node_shard
        if s is None:
            order = np.random.default_rng([seed, epoch]).permutation(len(self.train_set))
            step_size, first = batch_size, self.data_axis.rank * per_replica
        else:
            order = s.indices[np.random.default_rng([seed, epoch, s.node]).permutation(
                len(s.indices))]
            step_size, first = s.replicas_on_node * per_replica, s.position * per_replica
        out: list[int] = []
        for step in range(first_step, self.steps_per_epoch):
            batch = order[step * step_size:(step + 1) * step_size]
            out.extend(batch[first:first + per_replica].tolist())
        return out

    def slice_indices(self, step: int, position: int) -> list[int]:
        """The sample indices data replica `position` (of `data_axis.size`) trains on in step
        `step` (0-based, counted over the run) under the global shuffle: another replica's
        slice, for a replica group that covers a missing one (resilience.replicas)."""
        batch_size = self.config.train.batch_size
        per_replica = batch_size // self.data_axis.size
        epoch, at = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.config.run.seed, epoch]).permutation(
            len(self.train_set))
        batch = order[at * batch_size:(at + 1) * batch_size]
        return batch[position * per_replica:(position + 1) * per_replica].tolist()

    def batches(self, start_step: int, decode) -> Prefetcher:
        """Micro-batches (x, y) on the device from `start_step` on, epoch after epoch: one loader
        for the whole run (workers start once), `train.prefetch` batches ahead, decoded on the
        device by `decode` (see data.loader)."""
        sampler = EpochSampler(self.rank_indices, self.steps_per_epoch, start_step)
        source = run_loader(self.train_set, sampler, self.micro, self.num_workers,
                            self.mesh.device, seed=start_step // self.steps_per_epoch,
                            collate_fn=self.collate_fn, timeout_s=self.config.run.timeout_s)
        return Prefetcher(source, self.mesh.device, decode=decode,
                          depth=self.config.train.prefetch, workers=self.num_workers)


def device_decode(workload, model):
    """The workload's decode on the device, then the layout the model takes (layout.py)."""
    decode = workload.decode
    if not input_memory_format(model):
        return decode
    return lambda x: channels_last_input(decode(x) if decode is not None else x)

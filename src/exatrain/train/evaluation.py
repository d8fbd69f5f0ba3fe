"""The workload's metrics on a data set (validation, or a population's tournament set).

Validation samples are split over the data replicas like training batches (over data and shard
ranks). Every rank runs the same number of batches, because a sharded or split model's forward is
itself collective: the short ranks pad with a repeated sample and ignore its output. The sums of
every metric are reduced over the workload's metric axes (with the pipeline's, whose last stage
holds them), then finalized by the workload.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from ..comm import all_reduce, broadcast_object
from ..data.loader import collate, no_inherited_garbage
from ..parallel.data import unwrap
from ..parallel.nested import call_on, cut_batch, fp32, map_tensors
from ..parallel.pipe.model import PipelineModel


class Evaluation:
    def __init__(self, mesh, workload, model, data_axis, micro: int, num_workers: int,
                 precision, decode, new_graph_iteration):
        self.mesh, self.workload, self.model, self.data_axis = mesh, workload, model, data_axis
        self.micro, self.num_workers, self.precision = micro, num_workers, precision
        self.decode, self.new_graph_iteration = decode, new_graph_iteration

    def _to_device(self, batch):
        x, y = batch
        x = map_tensors(x, lambda t: t.to(self.mesh.device, non_blocking=True))
        y = y.to(self.mesh.device, non_blocking=True)
        return (self.decode(x) if self.decode is not None else x), y

    @torch.no_grad()
    def __call__(self, dataset) -> dict[str, float]:
        model = unwrap(self.model)
        was_training = model.training
        model.eval()
        replicas = self.data_axis.size
        indices = list(range(len(dataset)))[self.data_axis.rank::replicas]
        valid = len(indices)
        indices += indices[:1] * (-(-len(dataset) // replicas) - valid)
        sums: dict[str, torch.Tensor] = {}
        seen = 0
        with no_inherited_garbage(self.num_workers):   # starts the workers
            batches = iter(DataLoader(dataset, batch_size=self.micro, sampler=indices,
                                      num_workers=self.num_workers,
                                      collate_fn=self.workload.collate_fn or collate))
        for batch in batches:
            x, y = self._to_device(batch)
            if isinstance(model, PipelineModel):
                output = model.eval_batch(x)  # on the last stage's rank only
            else:
                self.new_graph_iteration()
                with self.precision.autocast():
                    output = call_on(model, x)
            keep = max(0, min(len(y), valid - seen))
            seen += len(y)
            if keep == 0 or output is None:
                continue
            valid_output = fp32(cut_batch(output, keep, len(y)))  # (every head)
            for key, value in self.workload.metric_sums(valid_output, y[:keep]).items():
                sums[key] = sums.get(key, 0) + value.detach().double().cpu()
        keys = sorted(sums)
        axes = tuple(self.workload.metric_axes)
        if isinstance(model, PipelineModel):  # the last stage's rank has the sums: share them
            pipe = self.mesh.axis("pipe")
            keys = broadcast_object(keys, pipe, src=pipe.size - 1)
            axes += ("pipe",)
        vector = torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float64)
                              for k in keys]).to(self.mesh.device)
        if self.mesh.plan.shard > 1 and "shard" not in axes:
            axes += ("shard",)
        all_reduce(vector, self.mesh.axis(*axes), tag="metric")
        vector = vector.cpu()
        model.train(was_training)
        return {k: float(v) for k, v in self.workload.finalize(dict(zip(keys, vector))).items()}

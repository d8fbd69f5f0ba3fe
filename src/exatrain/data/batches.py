"""How a loader worker hands a batch to the training process: batches a data set returned
already collated (`Collated`), samples stacked field by field into one shared-memory buffer
(`packed`, by the loader's `collate`), and batch buffers a worker reuses (`BufferRing`,
`batch_buffer`). The loader (`data.loader`) uses `collate`; readers that fill whole batches
(`data.cosmoflow`) use the buffers.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info

from ..errors import DataError


class Collated(tuple):
    """A batch that a data set's `__getitems__` returned already collated (e.g. read straight
    into one buffer): `collate` hands it on without copying. `lease`: the `BufferRing` slot its
    first tensor occupies in a loader worker; the training process frees the slot once it holds
    no view of that tensor any more (see `BufferRing`)."""

    lease: tuple | None = None

    @classmethod
    def of(cls, tensors, lease: tuple | None = None) -> "Collated":
        batch = cls(tensors)
        batch.lease = lease
        return batch

    def __reduce__(self):
        if self.lease is None:
            return tuple, (tuple(self),)
        return _received, (tuple(self), *self.lease)


def _received(tensors: tuple, in_use: torch.Tensor, slot: int) -> tuple:
    """Unpickled in the training process: the batch, as a plain tuple, whose first tensor's ring
    slot is freed when its storage is (no tensor or view of it left in this process)."""
    weakref.finalize(tensors[0].untyped_storage(), _free, in_use, slot)
    return tensors


def _free(in_use: torch.Tensor, slot: int) -> None:
    in_use[slot] = 0


def collate(batch):
    """The loader's collate function: `Collated` batches as they are; in a loader worker, samples
    that are tuples or lists of tensors stacked field by field into one shared-memory buffer
    (`packed`); the rest as PyTorch's."""
    if isinstance(batch, Collated):
        return batch if batch.lease is not None else tuple(batch)
    if get_worker_info() is not None:
        together = packed(batch)
        if together is not None:
            return together
    try:
        return default_collate(batch)
    except RuntimeError as exc:
        message = ragged_message(batch)
        if message is None:
            raise
        raise DataError(message) from exc


def ragged_message(samples: list) -> str | None:
    """Why `samples` do not stack into a batch, where a tensor or array of theirs differs in
    shape from one sample to the next (molecules of different sizes, sequences of different
    lengths), with the fix; None where every one stacks."""
    shapes = [_leaf_shapes(s) for s in samples]
    for name, shape in shapes[0].items():
        for j, other in enumerate(shapes[1:], start=1):
            if name in other and other[name] != shape:
                return (f"the samples of one batch differ in the shape of their {name}: {shape} "
                        f"in its sample 0, {other[name]} in its sample {j}. A batch stacks its "
                        f"samples, so each tensor of a sample needs one shape in every sample. "
                        f"Pad them in the data set to the largest size, with a mask or a count "
                        f"of the real entries as one more input (as the QM9 workload pads "
                        f"molecules), or crop them to one size; or batch them yourself: "
                        f"et.fit(..., collate_fn=) (graphs: the nodes concatenated, the edges "
                        f"offset, a graph index per node).")
    return None


def _leaf_shapes(sample) -> dict[str, tuple]:
    """{name: shape} of the tensors and arrays in one sample: in an (input, target) pair
    "input", "input 0", "input 'x'", "target"; else their path in the sample."""
    from torch.utils._pytree import MappingKey, SequenceKey, keystr, tree_flatten_with_path

    pair = isinstance(sample, (tuple, list)) and len(sample) == 2
    out = {}
    for path, leaf in tree_flatten_with_path(sample)[0]:
        if not isinstance(leaf, (torch.Tensor, np.ndarray)):
            continue
        if pair and path and isinstance(path[0], SequenceKey):
            name = ("input", "target")[path[0].idx]
            for key in path[1:]:
                name += f" {key.idx}" if isinstance(key, SequenceKey) else \
                    f" {key.key!r}" if isinstance(key, MappingKey) else keystr([key])
        else:
            name = f"sample{keystr(path)}"
        out[name] = tuple(leaf.shape)
    return out

def plain_collate(dataset) -> Callable | None:
    """The collate function a plain `DataLoader` over `dataset` needs, as a user writes one (the
    benchmarks' baselines): PyTorch's (None), or `collate` where the data set reads whole batches
    (its `__getitems__` returns them collated, which PyTorch's would stack again)."""
    return collate if hasattr(dataset, "__getitems__") else None


PACK_ALIGN = 64  # bytes: every field of a packed batch starts on a cache line


def packed(samples: list) -> list | None:
    """The batch of `samples` (each a tuple or list of tensors, field i of the same shape and
    dtype in every sample) as a list of stacked fields, every field a view of one new
    shared-memory buffer; None for samples of any other form.

    Why: a worker hands a batch to the training process through shared memory, one segment and
    one file descriptor per storage, passed over a socket (`torch.multiprocessing`). PyTorch's
    `default_collate` stacks each field into a segment of its own, so an (x, y) batch costs two
    hand-overs; one buffer halves them. With QM9's small batches (32 molecules, two fields) the
    hand-over is most of a batch's cost: one worker delivered 1.3-1.6x the samples per second
    with one buffer. The values, shapes and dtypes are default_collate's (a tuple of fields
    becomes a list, as there)."""
    first = samples[0] if samples else None
    if type(first) not in (tuple, list) or not first or any(
            type(s) is not type(first) or len(s) != len(first) for s in samples):
        return None
    layout, size = [], 0
    for field in zip(*samples):
        head = field[0]
        if type(head) is not torch.Tensor or head.requires_grad or not all(
                type(t) is torch.Tensor and t.shape == head.shape and t.dtype == head.dtype
                for t in field):
            return None
        size = -(-size // PACK_ALIGN) * PACK_ALIGN
        nbytes = len(field) * head.numel() * head.element_size()
        layout.append((size, nbytes, field))
        size += nbytes
    if size == 0:
        return None
    buffer = _shared_empty(size, torch.uint8)
    out = []
    for start, nbytes, field in layout:
        view = buffer[start:start + nbytes].view(field[0].dtype).view(len(field),
                                                                      *field[0].shape)
        torch.stack(field, out=view)
        out.append(view)
    return out


class BufferRing:
    """Batch buffers in shared memory that one loader worker reuses.

    Why: a worker hands a batch to the training process without copying only from shared
    memory, and a fresh shared-memory buffer per batch costs as much CPU as the read it holds
    (measured: HDF5 `read_direct` of a 16 MiB CosmoFlow 128³ sample took 11 ms of CPU into a
    reused buffer and 25-34 ms into a fresh one, whose pages are zeroed and faulted in one by
    one; the training process then maps the new segment again). A ring slot is taken by the
    worker (`take`) and freed by the training process when the batch's storage is freed there
    (a finalizer attached on unpickling: no tensor or view of the batch is left, so reusing the
    memory cannot change data anyone still reads; the pinned copy made for a GPU frees it at
    once). The flags live in one small shared tensor sent with every batch. When every slot is
    in use the worker takes a fresh buffer that is never reused (the old behaviour): a consumer
    that keeps batches costs speed, never correctness. At most `slots` buffers per worker stay
    allocated, as many as were in flight at once (the loader's prefetch and the prefetch queue).
    Nothing here communicates beyond the batch hand-over itself."""

    def __init__(self, slots: int = 8):
        self.slots = slots
        self.buffers: list[torch.Tensor] = []  # flat tensors over shared storages
        self.in_use: torch.Tensor | None = None

    def take(self, shape: tuple, dtype: np.dtype) -> tuple[torch.Tensor, tuple | None]:
        """(a buffer of `shape` and numpy `dtype`, its lease for `Collated.of`, None if unpooled)."""
        numel = math.prod(shape)
        kind = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        if self.in_use is None:
            self.in_use = torch.zeros(self.slots, dtype=torch.int32).share_memory_()
        for slot, buffer in enumerate(self.buffers):
            if int(self.in_use[slot]) == 0 and buffer.dtype == kind and buffer.numel() >= numel:
                self.in_use[slot] = 1
                return buffer[:numel].view(shape), (self.in_use, slot)
        buffer = _shared_empty(numel, kind)
        if len(self.buffers) == self.slots:
            return buffer.view(shape), None
        self.buffers.append(buffer)
        self.in_use[len(self.buffers) - 1] = 1
        return buffer.view(shape), (self.in_use, len(self.buffers) - 1)


def _shared_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor in a new shared-memory segment (what PyTorch's default_collate makes)."""
    like = torch.empty(0, dtype=dtype)
    return like.new(like._typed_storage()._new_shared(numel)).view(-1)


def batch_buffer(shape: tuple, dtype: np.dtype, ring: BufferRing | None = None
                 ) -> tuple[torch.Tensor, tuple | None]:
    """An empty CPU tensor for a batch of numpy `dtype`, and its lease: inside a loader worker,
    a slot of `ring` in shared memory (handing it to the training process then copies nothing);
    else numpy's memory, reused by the allocator from batch to batch (no lease)."""
    if get_worker_info() is None or ring is None:
        return torch.from_numpy(np.empty(shape, dtype=dtype)), None
    return ring.take(shape, dtype)

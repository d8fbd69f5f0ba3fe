"""The random stream of a tensor-parallel training forward, kept apart from the user's.

Replicated activations must get identical dropout masks on every rank of a tensor group, so each
training forward draws from a stream seeded by a value the group agrees on. That stream is
exatrain's: `ForwardRng.enter` saves the default generators' states (CPU, and every CUDA device
in use) and seeds them with the agreed seed; `exit` puts the saved states back. So every random
draw inside the model's forward (nn.Dropout, F.dropout, SDPA's dropout_p, a user's own noise)
is consistent over the group, and the user's global stream, outside the forward, continues
exactly as the user left it: augmentation, sampling and noise drawn between steps are the same
with and without tensor parallelism.

Why the default generators and not a torch.Generator object of ours: functional dropout and
SDPA take no generator, and activation checkpointing replays a block's masks in the backward
by restoring the default generators' states only (a private generator would draw new masks in
the recomputation and give wrong gradients).

The agreed seed comes from rank 0 without drawing from its stream: it is a hash of
`torch.initial_seed()` (the seed last given to torch.manual_seed, e.g. the Trainer's per-step
seed) and the number of training forwards since that seed was set, so micro-batches of one step
differ, a resumed run repeats the original's masks, and a user's loop that never reseeds still
gets new masks every forward. No communication here (the 8-byte seed broadcast is the caller's).
"""

from __future__ import annotations

import torch


class ForwardRng:
    def __init__(self):
        self._saved: tuple | None = None
        self._last_initial: int | None = None
        self._repeat = 0

    def next_seed(self) -> int:
        """A new seed for this training forward, from the user's seed without drawing from it."""
        initial = torch.initial_seed()
        if initial == self._last_initial:
            self._repeat += 1
        else:
            self._last_initial, self._repeat = initial, 0
        return hash((initial, self._repeat)) % 2 ** 62

    def enter(self, seed: int) -> None:
        """Save the user's generator states and seed exatrain's stream for this forward."""
        self.exit()  # a forward that raised never reached exit: give the user's state back first
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._saved = (torch.get_rng_state(), cuda)
        torch.manual_seed(seed)

    def reseed(self, seed: int) -> None:
        """Re-seed exatrain's stream inside the forward (sequence-parallel sites)."""
        torch.manual_seed(seed)

    def exit(self) -> None:
        """Give the user's generator states back (no-op outside a forward)."""
        if self._saved is None:
            return
        cpu, cuda = self._saved
        self._saved = None
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


__all__ = ["ForwardRng"]

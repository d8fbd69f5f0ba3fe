"""Code a user writes between the Linears tensor parallelism splits, on the user's road (`et.fit`
under Plan(tensor=2) against one process).

A column → row pair of Linears holds a slice of the features between the two layers on each rank.
Code there that works across the features (a softmax over them, a flip) computes on the slice:
the pair's autograd check (parallel/tensor/pairs.py) names the norms, reductions and products it
knows; the rest was trained silently differently (val_loss 0.4130 against one process's 0.4240
for the softmax, 0.3485 against 0.3318 for the flip). The check against the plain model before
the first step (parallel/verify.py) refuses them, naming the pair and the parent's forward, with
`parallel.tensor_pairs = false` as the fix, under which each trains as one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness import run_ranks


class SoftmaxBetween(nn.Module):
    """Attention-like weights over the hidden features."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(torch.softmax(self.fc1(x), dim=-1))


class FlipBetween(nn.Module):
    """The hidden features reversed (a reordering a model may learn to undo)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)).flip(-1))


class SumGate(nn.Module):
    """A gate from the sum over the hidden features (a reduction the pair's own check, on the
    first training forward, would name; the check before it finds it first)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 2)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(h.sum(-1, keepdim=True)))


MODELS = {"softmax": SoftmaxBetween, "flip": FlipBetween, "sum": SumGate}


def _fit(name: str, plan: dict, out_dir: str, parallel: dict) -> float | str:
    import exatrain as et

    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 6, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.tanh(x[:, :2]))
    try:
        return et.fit(MODELS[name], data, data, loss=F.mse_loss, plan=et.Plan(**plan),
                      train={"steps": 3, "batch_size": 4, "eval_every": 0, "num_workers": 0},
                      optim={"name": "sgd", "lr": 0.1}, run={"out_dir": out_dir},
                      parallel=parallel)["val_loss"]
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"


def _runs(out_dir: str) -> dict:
    return {(name, pairs): _fit(name, {"tensor": 2}, f"{out_dir}/{name}-{pairs}",
                                {"tensor_pairs": pairs})
            for name in MODELS for pairs in (True, False)}


def test_code_across_the_split_features_is_refused_and_trains_unpaired(tmp_path, one_thread):
    serial = {name: _fit(name, {}, str(tmp_path / "serial"), {}) for name in MODELS}
    for found in run_ranks(2, _runs, str(tmp_path / "tensor")):
        for name, forward in (("softmax", "SoftmaxBetween.forward"),
                              ("flip", "FlipBetween.forward"), ("sum", "SumGate.forward")):
            text = found[(name, True)]
            for words in ("TensorSplitError: under Plan(tensor=2) the model's output on the "
                          "training set's first sample differs", "the output of 'fc2' (Linear)",
                          "the last that agreed is the input of 'fc1' (Linear)", forward,
                          "('fc1', 'fc2')", "parallel.tensor_pairs = false"):
                assert words in text, (name, words, text)
        # the figure docs/how-to/tensor.md shows
        assert "the largest difference is 0.0404," in found[("softmax", True)]
        # unpaired, each Linear gathers its output: every model trains as one process
        for name in MODELS:
            assert abs(found[(name, False)] - serial[name]) <= 1e-6 * serial[name], \
                (name, found[(name, False)], serial[name])

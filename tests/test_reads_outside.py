"""parallel/reads.py: which weights a forward reads outside the layer holding them. `shard` and
`tensor` keep those whole (trained against one process in test_user_models_every_axis.py,
`mlp_tied`); here, what counts as such a read and that finding them leaves the run as it was."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from exatrain.parallel.reads import mark_reads_outside, read_outside, reads_outside


class Readers(nn.Module):
    """A tied decoder (read in the model's forward), a weight read by a sibling block, a
    weight only asked for its dtype and device, a BatchNorm and the user's own random draw."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.scale = nn.Linear(8, 8)
        self.block = nn.ModuleDict({"mix": nn.Linear(8, 8)})
        self.dec_bias = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        x = x.to(device=self.enc.weight.device, dtype=self.enc.weight.dtype)   # not a use
        h = self.bn(self.enc(x)) + 0.01 * torch.randn(x.shape[0], 8)
        h = self.block["mix"](h) * self.scale.weight.diagonal()    # read outside `scale`
        return F.linear(h, self.enc.weight.t(), self.dec_bias)      # read outside `enc`


def test_weights_read_outside_their_layer_are_found_and_nothing_else():
    torch.manual_seed(0)
    model = Readers()
    assert reads_outside(model, torch.randn(3, 4)) == {"enc.weight": "", "scale.weight": ""}


def test_finding_them_leaves_the_run_as_it_was():
    torch.manual_seed(0)
    model = Readers()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 4)
    rng = torch.get_rng_state()
    found = mark_reads_outside(model, x)
    assert found == {"enc.weight": "", "scale.weight": ""}
    assert model.training   # its mode restored
    assert torch.equal(torch.get_rng_state(), rng)   # its draws, and dropout's, are the run's
    for key, value in model.state_dict().items():   # BatchNorm's statistics untouched
        assert torch.equal(value, before[key]), key
    assert [n for n, p in model.named_parameters() if read_outside(p)] == \
        ["enc.weight", "scale.weight"]


def test_a_forward_that_fails_finds_nothing_and_leaves_the_failure_to_training():
    model = nn.Sequential(nn.Linear(4, 8))
    assert reads_outside(model, torch.randn(3, 5)) == {}   # wrong width: training says so
    assert model.training

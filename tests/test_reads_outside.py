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
    model.bn.eval()   # a user's frozen BatchNorm stays frozen
    found = reads_outside(model, x)
    mark_reads_outside(model, found)
    assert found == {"enc.weight": "", "scale.weight": ""}
    assert model.training and not model.bn.training   # every module's mode put back
    assert torch.equal(torch.get_rng_state(), rng)   # its draws, and dropout's, are the run's
    for key, value in model.state_dict().items():   # BatchNorm's statistics untouched
        assert torch.equal(value, before[key]), key
    assert [n for n, p in model.named_parameters() if read_outside(p)] == \
        ["enc.weight", "scale.weight"]


def test_a_forward_that_fails_finds_nothing_and_leaves_the_failure_to_training():
    model = nn.Sequential(nn.Linear(4, 8))
    assert reads_outside(model, torch.randn(3, 5)) == {}   # wrong width: training says so
    assert model.training


class Sneaky(nn.Module):
    """Reads no tests above catch by holder alone: a read made only in training, a block's
    norm called from outside its block, a parametrized weight read from the root, a bias."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
                                    for _ in range(2))
        self.enc = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))
        self.aux = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        x = self.blocks[-1][1](x) + F.linear(x, self.enc.weight) - self.head.bias
        if self.training:   # an auxiliary term only training adds
            x = x + 0 * self.aux.weight.sum()
        return self.head(x)


def test_reads_only_training_makes_calls_from_outside_and_parametrized_weights_are_found():
    torch.manual_seed(0)
    found = reads_outside(Sneaky(), torch.randn(3, 4))
    assert set(found) == {"blocks.1.1.weight", "blocks.1.1.bias", "aux.weight", "head.bias",
                          "enc.parametrizations.weight.original0",
                          "enc.parametrizations.weight.original1"}, found


def test_a_block_whose_own_layer_reads_its_weights_is_still_sharded_alone():
    """PyTorch's MultiheadAttention reads its out_proj's weight in its own forward: the block
    holding it runs then, so shard may still gather that block alone (read_outside_of)."""
    from exatrain.parallel.reads import read_outside_of

    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    found = reads_outside(model, torch.randn(2, 3, 8))
    assert found["0.layers.0.self_attn.out_proj.weight"] == "0.layers.0.self_attn"
    mark_reads_outside(model, found)
    block = model[0].layers[0]
    assert not read_outside_of("0.layers.0", block.parameters())
    assert read_outside_of("0.layers.0.self_attn.out_proj", block.parameters())

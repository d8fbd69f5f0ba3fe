"""Users' own models, written the way people write them, and the road they train on: `et.fit` on
whole samples from a TensorDataset with the user's loss, checked against the same model trained by
`et.fit` on one process. Shared by test_spatial_user_models (the `space` axis, issue 46 items 1-3)
and test_user_models_every_axis (every axis, item 6); test_spatial_user_models' docstring describes
the convolutional models and the tolerances.

  unet2d          a 2D U-Net (Conv2d, BatchNorm2d, ReLU, MaxPool2d, nearest Upsample, skip cat)
  mlp             an MLP as an nn.Module subclass (Linear, LayerNorm, GELU), per-sample targets
  transformer     a pre-norm transformer (LayerNorm, GELU MLP) with a hand-written causal
                  attention using `self.head_dim` (test_tensor_attention_fit's `Attention`)
  transformer_mha the same with nn.MultiheadAttention(batch_first=True) and a causal mask
  transformer_torch  PyTorch's nn.TransformerEncoder between an embedding and a head
  mlp_heads       `mlp` with a second head, forward returning a tuple of the two outputs
  mlp_named       the same returning a namedtuple of the two and a 0-dim auxiliary loss
  mlp_dict        the same returning a dict of the two heads
  mlp_numpy       `mlp`, its data set returning NumPy float32 arrays (as read from a file)
  mlp_probe       `mlp` with its trunk frozen (a pretrained trunk, `requires_grad_(False)`), only
                  the output layer trained
  mlp_compiled    `mlp` compiled by the user (`torch.compile(model)`) before `et.fit`
  mlp_weightnorm  `mlp` with `weight_norm` on its hidden layers (parametrized modules)
  mlp_f64         `mlp` in float64, weights and data (physics that needs the digits)
  fno             a 2D Fourier neural operator (complex weights on the field's FFT modes)
  mlp_tied        an autoencoder on `mlp`'s trunk whose decoder is the first layer's weight
                  transposed, used in forward (`F.linear(h, self.fc1.weight.t(), bias)`)
  unet_heads      the 3D U-Net with a field and a mask head, forward returning a dict
  cnn_conditioned a 2D per-pixel CNN of two inputs, forward(field, params): a Linear of the
                  parameters scales and shifts its features (FiLM); samples ((field, params), y)
  cnn_conditioned_planes  the same with the parameters broadcast as channels, a 1×1 convolution
                  in place of the Linear (what `space` takes)
  mlp_keywords    `mlp` of two named inputs, forward(x, t); samples ({"x": x, "t": t}, y)
"""

from __future__ import annotations

import collections
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import logged_losses, rel_err
from test_tensor_attention_fit import Attention

SEED = 11
ULP = torch.finfo(torch.float32).eps
# A BatchNorm shift's gradient is a sum over every voxel of the batch that nearly cancels: in
# float32 it keeps ~3 digits, whichever order the sum runs in (measured on the encoder: 3.4e-4
# relative between one process and Plan(data=2), 1.3e-3 under space=(1, 1, 2)). A wrong gradient
# (a missed halo, a block-local statistic, a loss over a block) moves updates by 10-100 %.
UPDATE_RTOL = 3e-3
STEPS = 4


class UNet3D(nn.Module):
    def __init__(self, channels: int = 4, norm: str = "batch", up: str = "nearest"):
        super().__init__()
        def block(cin, cout):
            layer = {"batch": lambda: nn.BatchNorm3d(cout), "group": lambda: nn.GroupNorm(2, cout),
                     "": nn.Identity}[norm]()
            return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), layer, nn.ReLU())
        c = channels
        self.enc = block(2, c)
        self.down = nn.MaxPool3d(2)
        self.mid = block(c, 2 * c)
        self.up = nn.Upsample(scale_factor=2, mode=up)
        self.dec = block(3 * c, c)
        self.head = nn.Conv3d(c, 1, 1)

    def forward(self, x):
        e = self.enc(x)
        m = self.up(self.mid(self.down(e)))
        return self.head(self.dec(torch.cat([e, m], dim=1)))


class Encoder3D(nn.Module):
    def __init__(self, norm: bool = True):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4) if norm else nn.Identity(), nn.ReLU(),
            nn.MaxPool3d(2),
            nn.Conv3d(4, 8, 3, padding=1), nn.BatchNorm3d(8) if norm else nn.Identity(), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8, 3))

    def forward(self, x):
        return self.head(self.pool(self.features(x)))


class CNN2D(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))

    def forward(self, x):
        return self.body(x)


class NormedHeadCNN2D(CNN2D):
    """`CNN2D` whose head, after the global pool, is weight-normed without a bias: a layer with
    no parameters of its own (its parametrization holds them) that runs on gathered tensors."""

    def __init__(self):
        super().__init__()
        self.body[-1] = nn.utils.parametrizations.weight_norm(nn.Linear(8, 2, bias=False))


class Periodic2D(nn.Module):
    """A surrogate on a periodic 2D domain (a longitude-periodic field, a cosmology slab)."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(2, c, 3, padding=1, padding_mode="circular")
        self.norm1 = nn.InstanceNorm2d(c, affine=True, track_running_stats=True)
        self.conv2 = nn.Conv2d(c, c, 5, padding=2, padding_mode="circular")
        self.norm2 = nn.LayerNorm(c)  # over channels, channels-last as in ConvNeXt
        self.head = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        x = F.relu(self.norm1(self.conv1(x)))
        x = self.norm2(self.conv2(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(F.gelu(x))


class UNet2D(nn.Module):
    def __init__(self, channels: int = 4):
        super().__init__()
        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())
        c = channels
        self.enc = block(2, c)
        self.down = nn.MaxPool2d(2)
        self.mid = block(c, 2 * c)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec = block(3 * c, c)
        self.head = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        e = self.enc(x)
        m = self.up(self.mid(self.down(e)))
        return self.head(self.dec(torch.cat([e, m], dim=1)))


class UserMLP(nn.Module):
    def __init__(self, n_in: int = 6, hidden: int = 32, n_out: int = 2):
        super().__init__()
        self.fc1 = nn.Linear(n_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.act = nn.GELU()
        self.out = nn.Linear(hidden, n_out)

    def forward(self, x):
        x = self.act(self.norm(self.fc1(x)))
        return self.out(self.act(self.fc2(x)))


class ForceMLP(UserMLP):
    """A learned energy of 6 coordinates and its forces, -dE/dx, trained on both, as force
    fields are: the derivative taken in the forward, inside torch.enable_grad() (evaluation runs
    without gradients), with create_graph=self.training (the loss's backward differentiates it
    again)."""

    def __init__(self):
        super().__init__(n_out=1)

    def forward(self, x):
        with torch.enable_grad():
            x.requires_grad_(True)
            energy = super().forward(x)
            forces = -torch.autograd.grad(energy.sum(), x, create_graph=self.training)[0]
        return torch.cat([energy, forces], dim=1)


def _dimenet_forces() -> nn.Module:
    """exatrain's DimeNet++ as an energy, its forces the model (et.models.Forces), small."""
    import exatrain as et

    energy = et.models.DimeNetPlusPlus(hidden=8, blocks=1, int_emb=4, basis_emb=3, out_emb=8,
                                       radial=3, spherical=3, cutoff=5.0, max_z=80)
    for output in energy.outputs:   # the paper's zero output weights would give zero forces
        nn.init.normal_(output.out.weight, std=0.1)
    return et.models.Forces(energy)


class GraphNet(nn.Module):
    """Message passing on molecules of different sizes, written as people write it without a
    graph library: a batch is the graphs' nodes concatenated, their edges offset into them and
    a graph index per node (`collate_graphs`, as PyTorch Geometric batches); sums by index_add_."""

    def __init__(self, n_in: int = 4, hidden: int = 32):
        super().__init__()
        self.embed = nn.Linear(n_in, hidden)
        self.message = nn.Linear(hidden, hidden)
        self.update = nn.Linear(2 * hidden, hidden)
        self.readout = nn.Linear(hidden, 1)

    def forward(self, nodes, edges, graph):
        h = torch.tanh(self.embed(nodes))
        for _ in range(2):
            sent = self.message(h)[edges[0]]
            received = torch.zeros_like(h).index_add_(0, edges[1], sent)
            h = torch.tanh(self.update(torch.cat([h, received], dim=1)))
        pooled = torch.zeros(int(graph.max()) + 1, h.shape[1], dtype=h.dtype, device=h.device)
        return self.readout(pooled.index_add_(0, graph, h))


class Molecules(torch.utils.data.Dataset):
    """8 graphs of 3 to 7 atoms (4 features each), bonds in a ring; the target a per-graph
    energy from the atoms and the bonds. Samples `((nodes, edges), energy)`."""

    def __init__(self):
        g = torch.Generator().manual_seed(4)
        self.graphs = []
        for _ in range(8):
            n = int(torch.randint(3, 8, (1,), generator=g))
            nodes = torch.randn(n, 4, generator=g)
            ring = torch.arange(n)
            edges = torch.cat([torch.stack([ring, ring.roll(1)]),
                               torch.stack([ring.roll(1), ring])], dim=1)
            bonds = (nodes[edges[0]] * nodes[edges[1]]).sum() / n
            energy = torch.tanh(nodes).sum(0)[:1] * 0.3 + 0.1 * bonds
            self.graphs.append(((nodes, edges), energy))

    def __len__(self):
        return len(self.graphs)

    def __getitem__(self, i):
        return self.graphs[i]


def collate_graphs(samples: list):
    """A batch of graphs: nodes concatenated, edges offset, a graph index per node."""
    nodes, edges, graph, offset = [], [], [], 0
    for i, ((x, e), _) in enumerate(samples):
        nodes.append(x)
        edges.append(e + offset)
        graph.append(torch.full((len(x),), i))
        offset += len(x)
    return (torch.cat(nodes), torch.cat(edges, 1), torch.cat(graph)), \
        torch.stack([energy for _, energy in samples])


class LinearProbe(UserMLP):
    """A pretrained trunk, frozen, under a trained output layer (transfer learning)."""

    def __init__(self):
        super().__init__()
        for layer in (self.fc1, self.norm, self.fc2):
            layer.requires_grad_(False)


class RunningNormMLP(UserMLP):
    """`UserMLP` on inputs centred by a running mean it keeps itself: a buffer that each training
    forward updates from its batch, after using it (an exponential average of the mean); and an
    annealed output gain, decayed in place before its use, which the backward reads (autograd
    saved it: averaging it in place would fail the backward)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("input_mean", torch.zeros(6))
        self.register_buffer("gain", torch.full((2,), 2.0))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.gain.mul_(0.9)
        out = super().forward(x - self.input_mean) * self.gain
        if self.training:
            with torch.no_grad():
                self.input_mean.lerp_(x.mean(0), 0.5)
        return out


class WeightNormMLP(UserMLP):
    """`UserMLP` with weight normalisation on its hidden layers (parametrized modules)."""

    def __init__(self):
        super().__init__()
        norm = nn.utils.parametrizations.weight_norm
        self.fc1, self.fc2 = norm(self.fc1), norm(self.fc2)


class OldWeightNormMLP(UserMLP):
    """`UserMLP` with PyTorch's older `torch.nn.utils.weight_norm` on its hidden layers: a hook
    computes each `weight` from the parameters `weight_g` and `weight_v`."""

    def __init__(self):
        super().__init__()
        with warnings.catch_warnings():  # torch: deprecated in favour of parametrizations
            warnings.simplefilter("ignore", FutureWarning)
            self.fc1, self.fc2 = nn.utils.weight_norm(self.fc1), nn.utils.weight_norm(self.fc2)


class NormedCNN2D(nn.Module):
    """A per-pixel 2D surrogate with a weight-normed and a spectrally normed (dilated)
    convolution: parametrized layers whose weights are computed from their parameters at every
    forward, the spectral norm with a power iteration that steps its state; a ReLU applied in
    place on a convolution's output (under `tensor` that convolution's output is gathered)."""

    def __init__(self):
        super().__init__()
        param = nn.utils.parametrizations
        self.conv1 = param.weight_norm(nn.Conv2d(2, 8, 3, padding=1))
        self.conv2 = param.spectral_norm(nn.Conv2d(8, 8, 3, padding=2, dilation=2))
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        h = self.conv3(F.gelu(self.conv2(F.gelu(self.conv1(x)))))
        return self.head(F.relu(h, inplace=True))   # in place on what conv3 returns


class SubPixelCNN(nn.Module):
    """A super-resolution-style per-pixel net: space-to-depth (`nn.PixelUnshuffle`), convolutions
    at half resolution, then sub-pixel upsampling (`nn.PixelShuffle`) back."""

    def __init__(self):
        super().__init__()
        self.down = nn.PixelUnshuffle(2)
        self.conv1 = nn.Conv2d(8, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 4, 3, padding=1)
        self.up = nn.PixelShuffle(2)

    def forward(self, x):
        return self.up(self.conv2(F.gelu(self.conv1(self.down(x)))))


class SpectralConv2d(nn.Module):
    """A Fourier layer: the lowest modes of the field's 2D FFT mixed by complex weights."""

    def __init__(self, channels: int, modes: int):
        super().__init__()
        scale = 1 / channels ** 2
        shape = (channels, channels, modes, modes)
        self.low = nn.Parameter(scale * torch.rand(*shape, dtype=torch.cfloat))
        self.high = nn.Parameter(scale * torch.rand(*shape, dtype=torch.cfloat))
        self.modes = modes

    def forward(self, x):
        m = self.modes
        spectrum = torch.fft.rfft2(x)
        out = torch.zeros(*spectrum.shape, dtype=torch.cfloat, device=x.device)
        out[..., :m, :m] = torch.einsum("bixy,ioxy->boxy", spectrum[..., :m, :m], self.low)
        out[..., -m:, :m] = torch.einsum("bixy,ioxy->boxy", spectrum[..., -m:, :m], self.high)
        return torch.fft.irfft2(out, s=x.shape[-2:])


class FNO2d(nn.Module):
    """A Fourier neural operator: lift, Fourier layers beside pointwise convolutions, project."""

    def __init__(self, width: int = 8, modes: int = 4, depth: int = 2):
        super().__init__()
        self.lift = nn.Conv2d(2, width, 1)
        self.fourier = nn.ModuleList(SpectralConv2d(width, modes) for _ in range(depth))
        self.pointwise = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(depth))
        self.project = nn.Conv2d(width, 1, 1)

    def forward(self, x):
        x = self.lift(x)
        for fourier, pointwise in zip(self.fourier, self.pointwise):
            x = F.gelu(fourier(x) + pointwise(x))
        return self.project(x)


class TiedAutoencoder(nn.Module):
    """An autoencoder whose decoder is its encoder's weight transposed, used in forward: a
    weight read outside its layer."""

    def __init__(self, n_in: int = 6, hidden: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(n_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.decoder_bias = nn.Parameter(torch.zeros(n_in))

    def forward(self, x):
        h = F.gelu(self.fc2(F.gelu(self.norm(self.fc1(x)))))
        return F.linear(h, self.fc1.weight.t(), self.decoder_bias)


TOKENS, WIDTH, HEADS = 8, 16, 4


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_head: int, mha: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, n_head, batch_first=True) if mha \
            else Attention(dim, n_head)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.ln1(x)
        if isinstance(self.attn, nn.MultiheadAttention):
            t = x.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            h = self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        else:
            h = self.attn(h)
        x = x + h
        return x + self.mlp(self.ln2(x))


class UserTransformer(nn.Module):
    def __init__(self, n_in: int = 6, dim: int = WIDTH, n_head: int = HEADS, depth: int = 2,
                 mha: bool = False):
        super().__init__()
        self.embed = nn.Linear(n_in, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, n_head, mha) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TorchTransformer(nn.Module):
    """PyTorch's own nn.TransformerEncoder (whose evaluation takes a fused fast path)."""

    def __init__(self, n_in: int = 6, dim: int = WIDTH, n_head: int = HEADS, depth: int = 2):
        super().__init__()
        self.embed = nn.Linear(n_in, dim)
        layer = nn.TransformerEncoderLayer(dim, n_head, dim_feedforward=2 * dim, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=depth, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)))


Heads = collections.namedtuple("Heads", "first second aux")


class TwoHeadMLP(UserMLP):
    """Two heads on one trunk, returned as a tuple; `as_="named"`: as a namedtuple with an
    auxiliary loss (0-dim) beside them; `as_="dict"`: as a dict."""

    def __init__(self, as_: str = "tuple"):
        super().__init__(n_out=1)
        self.second = nn.Linear(32, 1)
        self.as_ = as_

    def forward(self, x):
        h = self.act(self.fc2(self.act(self.norm(self.fc1(x)))))
        if self.as_ == "named":
            return Heads(self.out(h), self.second(h), 1e-2 * h.square().mean())
        if self.as_ == "dict":
            return {"field": self.out(h), "mask": self.second(h)}
        return self.out(h), self.second(h)


class TwoHeadUNet(UNet3D):
    """A 3D U-Net with a field head and a mask head, returned as a dict."""

    def __init__(self):
        super().__init__()
        self.mask = nn.Conv3d(4, 1, 1)

    def forward(self, x):
        e = self.enc(x)
        h = self.dec(torch.cat([e, self.up(self.mid(self.down(e)))], dim=1))
        return {"field": self.head(h), "mask": self.mask(h)}


class ConditionedCNN2D(nn.Module):
    """A per-pixel 2D surrogate of a field and the run's physical parameters, two inputs
    (`forward(self, field, params)`): the parameters scale and shift the features (FiLM)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 8, 3, padding=1)
        self.film = nn.Linear(3, 16)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 1, 1)

    def forward(self, field, params):
        scale, shift = self.film(params)[:, :, None, None].chunk(2, dim=1)
        h = F.gelu(self.conv1(field)) * (1 + scale) + shift
        return self.head(F.gelu(self.conv2(h)))


class ChannelConditionedCNN2D(ConditionedCNN2D):
    """The same conditioning written for `space`: the parameters, given as (N, 1, 3), broadcast
    over the field as channels, the scale and shift from a 1×1 convolution of them (the FiLM
    Linear per pixel). Under `space` the field is cut into blocks, the parameters are not."""

    def __init__(self):
        super().__init__()
        self.film = nn.Conv2d(3, 16, 1)

    def forward(self, field, params):
        planes = params.flatten(1)[:, :, None, None].expand(-1, -1, *field.shape[2:])
        scale, shift = self.film(planes).chunk(2, dim=1)
        h = F.gelu(self.conv1(field)) * (1 + scale) + shift
        return self.head(F.gelu(self.conv2(h)))


class KeywordMLP(UserMLP):
    """`mlp` of two named inputs, `forward(self, x, t)` with a data set giving
    `{"x": x, "t": t}`: the time `t` (N, 1) joins the features."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 32)

    def forward(self, x, t):
        return super().forward(torch.cat([x, t], dim=-1))


class SeveralInputs(torch.utils.data.Dataset):
    """Samples `(inputs, target)` whose inputs are a tuple (`as_="tuple"`) or a dict of tensors."""

    def __init__(self, inputs: dict, target: torch.Tensor, as_: str = "tuple"):
        self.inputs, self.target, self.as_ = inputs, target, as_

    def __len__(self):
        return len(self.target)

    def __getitem__(self, i):
        one = {k: v[i] for k, v in self.inputs.items()}
        return (tuple(one.values()) if self.as_ == "tuple" else one), self.target[i]


def heads_loss(output, target):
    """The loss of a model of several outputs: each head against its part of the target (and
    the namedtuple's auxiliary loss)."""
    if isinstance(output, dict):
        first, second, aux = output["field"], output["mask"], 0.0
    elif hasattr(output, "_fields"):
        first, second, aux = output.first, output.second, output.aux
    else:
        (first, second), aux = output, 0.0
    return F.mse_loss(first, target[:, :1]) + 0.5 * F.mse_loss(second, target[:, 1:]) + aux


MODELS = {"unet": lambda: UNet3D(), "unet_plain": lambda: UNet3D(norm=""),
          "unet_group": lambda: UNet3D(norm="group"),
          "unet_trilinear": lambda: UNet3D(up="trilinear"), "periodic": Periodic2D,
          "encoder": lambda: Encoder3D(), "encoder_plain": lambda: Encoder3D(norm=False),
          "cnn2d": CNN2D, "unet2d": UNet2D, "mlp": UserMLP, "transformer": UserTransformer,
          "transformer_mha": lambda: UserTransformer(mha=True), "mlp_heads": TwoHeadMLP,
          "transformer_torch": TorchTransformer,
          "mlp_named": lambda: TwoHeadMLP("named"), "mlp_dict": lambda: TwoHeadMLP("dict"),
          "mlp_numpy": UserMLP, "mlp_probe": LinearProbe, "mlp_tied": TiedAutoencoder,
          "mlp_compiled": lambda: torch.compile(UserMLP(), backend="eager"),
          "mlp_weightnorm": WeightNormMLP, "mlp_oldweightnorm": OldWeightNormMLP,
          "mlp_runningnorm": RunningNormMLP,
          "cnn_normed": NormedCNN2D, "cnn2d_normed_head": NormedHeadCNN2D, "cnn_subpixel": SubPixelCNN, "fno": FNO2d,
          "mlp_f64": lambda: UserMLP().double(),
          "unet_heads": TwoHeadUNet, "cnn_conditioned": ConditionedCNN2D,
          "cnn_conditioned_planes": ChannelConditionedCNN2D,
          "mlp_keywords": KeywordMLP, "mlp_forces": ForceMLP, "gnn": GraphNet,
          "dimenet_forces": lambda: _dimenet_forces()}
COLLATE = {"gnn": collate_graphs}   # models whose samples do not stack


def build(name: str) -> nn.Module:
    torch.manual_seed(SEED)  # the same initial weights in every process
    return MODELS[name]()


class NumpySamples(torch.utils.data.TensorDataset):
    """Samples as NumPy arrays, as a data set reading files returns them."""

    def __getitem__(self, index):
        return tuple(t.numpy() for t in super().__getitem__(index))


def dataset(name: str) -> torch.utils.data.TensorDataset:
    if name == "mlp_numpy":
        return NumpySamples(*dataset("mlp").tensors)
    if name == "mlp_f64":
        return torch.utils.data.TensorDataset(*(t.double() for t in dataset("mlp").tensors))
    if name == "gnn":
        return Molecules()
    if name == "dimenet_forces":   # 8 frames of EMT relaxations: atoms and their forces
        import numpy as np

        from exatrain.data.catalysis import relax_system
        rng = np.random.default_rng(2)
        frames = [relax_system(rng, frames=4, rattle=0.15) for _ in range(2)]
        z = torch.from_numpy(np.concatenate([f["z"] for f in frames]).astype(np.float32))
        pos = torch.from_numpy(np.concatenate([f["pos"] for f in frames]))
        forces = torch.from_numpy(np.concatenate([f["forces"] for f in frames]))
        return torch.utils.data.TensorDataset(torch.cat([z[..., None], pos], -1), forces)
    if name == "mlp_forces":   # an energy and its forces at 6 coordinates
        x, _ = dataset("mlp").tensors
        energy = 0.5 * (x ** 2).sum(1, keepdim=True) + torch.sin(x[:, :1])
        forces = -(x + torch.cat([torch.cos(x[:, :1]), torch.zeros(len(x), 5)], dim=1))
        return torch.utils.data.TensorDataset(x, torch.cat([energy, forces], dim=1))
    if name == "mlp_keywords":   # a time beside the features, the target depending on both
        x, y = dataset("mlp").tensors
        t = torch.linspace(0, 1, len(x))[:, None]
        return SeveralInputs({"x": x, "t": t}, y * (1 + t), as_="dict")
    if name.startswith("cnn_conditioned"):   # the parameters scale the per-pixel target
        field, target = dataset("cnn2d_field").tensors
        params = torch.randn(len(field), 3, generator=torch.Generator().manual_seed(5))
        target = target * (1 + 0.5 * params[:, :1, None, None])
        if name.endswith("_planes"):   # (N, 1, 3): three dims, fewer than the field's four
            params = params[:, None]
        return SeveralInputs({"field": field, "params": params}, target)
    g = torch.Generator().manual_seed(3)
    if name.startswith("mlp") or name.startswith("transformer"):   # per-sample / per-token targets
        x = torch.randn(8, *((TOKENS,) if not name.startswith("mlp") else ()), 6, generator=g)
        y = torch.tanh(x[..., :2] * 2) + 0.1 * torch.randn(*x.shape[:-1], 2, generator=g)
        if name == "mlp_tied":   # an autoencoder's target: its input
            y = x.clone()
        if not name.startswith("mlp"):
            y = y.roll(1, dims=1)   # the target of a token is its predecessor's: attention needed
        return torch.utils.data.TensorDataset(x, y)
    planar = ("cnn2d", "periodic", "unet2d", "fno", "cnn_normed", "cnn_subpixel",
              "cnn2d_field", "cnn2d_normed_head")
    spatial = (16, 16) if name in planar else (16, 16, 16)
    x = torch.randn(8, 2, *spatial, generator=g)
    if name.startswith("unet") or name in planar[1:-1]:  # per-voxel targets
        y = 0.3 * x[:, :1] + 0.5 * torch.randn(8, 1, *spatial, generator=g)
        if name == "unet_heads":   # a second per-voxel target: where the field is high
            y = torch.cat([y, (x[:, 1:] > 0.5).float()], dim=1)
    else:                          # per-sample targets
        y = torch.randn(8, 2 if name.startswith("cnn2d") else 3, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def fit(name: str, plan: dict, out_dir: str) -> dict:
    """`et.fit` as a user calls it; every rank returns its run's losses and final weights.
    `plan`: the Plan's degrees, under the key "parallel" any [parallel] options, under "optim"
    the optimizer's name (default sgd)."""
    import exatrain as et
    from exatrain.train.checkpoints import checkpoint

    plan = dict(plan)
    options = plan.pop("parallel", {})
    optimizer = plan.pop("optim", "sgd")

    data = dataset(name)
    loss = heads_loss if name.endswith(("_heads", "_named", "_dict")) else F.mse_loss
    # a compiled model is compiled again after the layout, with parallel.compile's settings
    parallel = {"compile_backend": "eager"} if name.endswith("_compiled") else {}
    parallel.update(options)
    summary = et.fit(lambda: build(name), data, data, loss=loss, plan=et.Plan(**plan),
                     train={"steps": STEPS, "batch_size": 4, "log_every": 1, "eval_every": 0,
                            "num_workers": 0},
                     optim={"name": optimizer, "lr": 0.1}, run={"out_dir": out_dir},
                     parallel=parallel, collate_fn=COLLATE.get(name))
    run_dir = Path(summary["run_dir"])
    state = checkpoint.full_model_state(checkpoint.latest(run_dir)) \
        if int(os.environ.get("RANK", "0")) == 0 else None
    return {"losses": logged_losses(run_dir), "val_loss": summary["val_loss"], "state": state,
            "zero_stage": summary.get("zero_stage"),
            "plan": summary["plan"], "bytes_per_step": summary["bytes_per_step"]}


def check(name: str, plan: dict, reference: dict, runs: list) -> None:
    from exatrain.workloads.user import uncompiled

    start = uncompiled(build(name))[0].state_dict()   # a compiled model's keys are its module's
    ref_losses = torch.tensor(list(reference["losses"].values()))
    for run in runs:  # every rank reports its replica's loss
        assert list(run["losses"]) == list(reference["losses"]) == list(range(1, STEPS + 1))
        losses = torch.tensor(list(run["losses"].values()))
        assert rel_err(losses, ref_losses) <= 1e-5, (name, plan, losses, ref_losses)
        assert run["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    state, trained = runs[0]["state"], 0.0
    assert state.keys() == reference["state"].keys()
    keys = sorted(k for k in state if not k.endswith("num_batches_tracked"))
    flat = torch.cat([state[k].double().flatten() for k in keys])
    ref_flat = torch.cat([reference["state"][k].double().flatten() for k in keys])
    assert float((flat - ref_flat).norm() / ref_flat.norm()) <= 1e-5, (name, plan)
    for key, value in reference["state"].items():
        if key.endswith("num_batches_tracked"):
            assert torch.equal(state[key], value), key
            continue
        update, ref_update = (state[key] - start[key]).double(), (value - start[key]).double()
        size = float(value.abs().max())
        if float(ref_update.abs().max()) <= 1e-5 * size:
            # no gradient (a conv bias before a BatchNorm): only rounding moved it, both runs
            assert float(update.abs().max()) <= 1e-5 * size, (name, plan, key, update)
            continue
        # UPDATE_RTOL of the update plus 16 float32 ulps of the stored weight
        diff = float((update - ref_update).abs().max())
        bound = UPDATE_RTOL * float(ref_update.abs().max()) + 16 * ULP * size
        assert diff <= bound, (name, plan, key, diff / float(ref_update.abs().max()))
        trained = max(trained, float(ref_update.abs().max()) / size)
    assert trained > 1e-2, (name, "the steps barely changed the weights: the check is void")



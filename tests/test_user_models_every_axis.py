"""Issue 46, item 6: users' own models on every axis that applies, each trained by `et.fit` as a
user calls it and checked against the same model trained by `et.fit` on one process.

The models (tests/user_models.py): the 3D U-Net with BatchNorm and nearest upsampling (`unet`),
with GroupNorm (`unet_group`), with trilinear upsampling (`unet_trilinear`); a 2D U-Net
(`unet2d`); an MLP subclass with LayerNorm and GELU (`mlp`); a pre-norm transformer with a
hand-written causal attention using `self.head_dim` (`transformer`), one with
nn.MultiheadAttention (`transformer_mha`) and PyTorch's nn.TransformerEncoder
(`transformer_torch`, whose evaluation takes a fused path reading its Linears' weights whole); models of several outputs, trained on a loss of each:
an MLP returning a tuple of two heads (`mlp_heads`), the same returning a namedtuple of the two
and a 0-dim auxiliary loss (`mlp_named`) or a dict of the two (`mlp_dict`), and a U-Net
returning a dict of two (`unet_heads`); and the MLP on a data set of NumPy samples
(`mlp_numpy`); the MLP with its trunk frozen (`mlp_probe`: a frozen layer must not train, and
a pipeline stage may have nothing to train); an autoencoder whose decoder is its first layer's
weight transposed (`mlp_tied`: a weight the forward reads outside its layer, which `shard`
must gather and `tensor` keep whole; under `pipe` it is refused, tests/test_pipe_edges.py);
the MLP in float64 (`mlp_f64`: equal to one process within 1e-12, gradients reduced in
float64, under FSDP2 and ZeRO-1/2 alike); a 2D Fourier neural operator (`fno`: complex weights, whose gradient norm and sharding
must take complex numbers); the MLP compiled by the user before `et.fit` (`mlp_compiled`: laid out from its plain module,
then compiled); the MLP with weight normalisation (`mlp_weightnorm`: parametrized layers stay
whole under `tensor`), and with PyTorch's older weight_norm (`mlp_oldweightnorm`: a hook computes
each weight from `weight_g` and `weight_v`, so `tensor` keeps those layers whole too); a 2D
per-pixel CNN with a weight-normed and a spectrally normed convolution (`cnn_normed`: under
`space` the spatial layers compute the whole weight from the parametrizations at each forward);
a sub-pixel CNN (`cnn_subpixel`: nn.PixelUnshuffle down, nn.PixelShuffle up, block-local under
`space`); a 2D classifier with a weight-normed head after its global pool, without a bias
(`cnn2d_normed_head`: under `space` that head runs on gathered tensors, its parametrization's
gradients counted once); the MLP on inputs centred by a running mean it keeps in a buffer (`mlp_runningnorm`:
each replica updates it from its share of the batch, and the replicas average it); models of
several inputs: a 2D surrogate of a field and three physical parameters, `forward(self, field,
params)`, its features scaled and shifted by a Linear of the parameters (`cnn_conditioned`, on
samples `((field, params), target)`), the same with the parameters broadcast over the field as
channels and a 1×1 convolution in place of the Linear (`cnn_conditioned_planes`: under `space`
the field is cut into blocks, the parameters reach every rank whole), and the MLP of two named
inputs, `forward(self, x, t)` on samples `({"x": x, "t": t}, target)` (`mlp_keywords`); a
message-passing net on molecules of 3 to 7 atoms batched by the user's collate_fn (nodes
concatenated, edges offset, a graph index per node: `gnn`, samples that do not stack); the
MLP as a learned energy whose forward returns it and its forces, -dE/dx by torch.autograd.grad,
trained on both (`mlp_forces`: the step differentiates the derivative again, through the split
layers' collectives under `tensor`; tests/test_user_derivatives.py has the Plans refused);
exatrain's DimeNet++ as a user's energy with `et.models.Forces`, trained on the forces of EMT
relaxations of adsorbates on metal patches (`dimenet_forces`).

Each cell: 4 SGD steps of batch 4 (float32), then `user_models.check`: every logged loss and the
validation loss within 1e-5 relative, the final weights within 1e-5 in relative norm over the
whole model, and per tensor the update within 3e-3 of the serial update (plus 16 ulps). Measured
(2026-11): weights 1e-8 (MLP, transformers) to 4e-7 (3D U-Nets) in relative norm, losses <= 1.4e-6.
Each axis of the plan must have moved bytes every step (the run's own `bytes_per_step`), and under
`tensor` the Linears must be split (the hand-written attention on a share of its heads;
nn.MultiheadAttention is kept whole, its feed-forward split): a cell that laid nothing out on
its axis would equal serial trivially.

The cells of one world size are trained in one batch (one job on the rank pool trains every model
of every selected cell in turn), so the file costs two pool jobs and one serial run per model.
A cell that raises is reported with its message; it fails its own test only.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from harness import run_ranks
from user_models import COLLATE, check

PLANS = {
    "data2": {"data": 2}, "shard2": {"shard": 2}, "tensor2": {"tensor": 2},
    "pipe2": {"pipe": 2}, "space112": {"space": (1, 1, 2)}, "space121": {"space": (1, 2, 1)},
    "space122": {"space": (1, 2, 2)}, "data2-space112": {"data": 2, "space": (1, 1, 2)},
    "tensor4": {"tensor": 4}, "data2-tensor2": {"data": 2, "tensor": 2},
    "shard2-zero1": {"shard": 2, "parallel": {"zero_stage": 1}},
    "shard2-zero2": {"shard": 2, "parallel": {"zero_stage": 2}},
}
UNETS = ("unet", "unet_group", "unet_trilinear")
CELLS = [
    *[(m, p) for m in UNETS for p in ("data2", "shard2", "space112", "space122",
                                      "data2-space112")],
    *[("unet2d", p) for p in ("data2", "space121")],
    *[("mlp", p) for p in ("data2", "shard2", "tensor2", "pipe2")],
    *[("mlp_numpy", p) for p in ("data2", "pipe2")],
    *[("mlp_probe", p) for p in ("data2", "shard2", "tensor2", "pipe2")],
    *[("mlp_tied", p) for p in ("data2", "shard2", "tensor2")],
    *[(m, p) for m in ("mlp_compiled", "mlp_weightnorm", "mlp_oldweightnorm")
      for p in ("data2", "shard2", "tensor2", "pipe2")],
    *[("cnn_normed", p) for p in ("data2", "space121", "tensor2")],
    *[("cnn_subpixel", p) for p in ("space121", "space122")],
    ("cnn2d_normed_head", "space121"),
    *[("mlp_runningnorm", p) for p in ("data2", "shard2", "data2-tensor2")],
    *[("transformer", p) for p in ("data2", "shard2", "tensor2", "pipe2", "tensor4",
                                   "data2-tensor2")],
    *[("transformer_mha", p) for p in ("data2", "shard2", "tensor2", "pipe2", "data2-tensor2")],
    *[("transformer_torch", p) for p in ("data2", "shard2", "tensor2", "pipe2")],
    *[("mlp_heads", p) for p in ("data2", "shard2", "tensor2", "pipe2")],
    *[(m, p) for m in ("mlp_named", "mlp_dict") for p in ("data2", "shard2", "tensor2", "pipe2")],
    *[("unet_heads", p) for p in ("space112", "space122")],
    *[("fno", p) for p in ("data2", "shard2", "tensor2", "pipe2")],
    *[("mlp_f64", p) for p in ("data2", "shard2", "shard2-zero1", "shard2-zero2", "tensor2",
                               "pipe2")],
    *[(m, p) for m in ("cnn_conditioned", "mlp_keywords") for p in ("data2", "shard2", "tensor2")],
    *[("cnn_conditioned_planes", p) for p in ("space121", "space122")],
    *[("mlp_forces", p) for p in ("data2", "shard2-zero2", "tensor2")],
    *[("dimenet_forces", p) for p in ("data2", "shard2-zero2")],
    *[("gnn", p) for p in ("data2", "shard2", "shard2-zero2", "tensor2")],
]
# cells that do not train as one process today: (model, plan) -> the defect, named
XFAIL: dict[tuple[str, str], str] = {}
HEADS_OF = {"transformer": 4}


def world(plan: str) -> int:
    return math.prod(math.prod(v) if isinstance(v, tuple) else v
                     for axis, v in PLANS[plan].items() if axis != "parallel")


def train_cells(cells: list, out_dir: str) -> dict:
    """On every rank: `user_models.fit` for each cell in turn; a cell that raises gives its
    message (and leaves no process group behind for the next)."""
    import torch.distributed as dist

    from user_models import fit

    out = {}
    for model, plan in cells:
        try:
            out[model, plan] = fit(model, PLANS[plan], os.path.join(out_dir, f"{model}-{plan}"))
            if "tensor" in PLANS[plan]:
                out[model, plan]["layout"] = tensor_layout(model, plan)
        except Exception as exc:  # noqa: BLE001 - the message is the result
            out[model, plan] = {"error": f"{type(exc).__name__}: {exc}"}
            if dist.is_initialized():
                dist.destroy_process_group()
    return out


def tensor_layout(model: str, plan: str) -> dict:
    """How `tensor` lays the model out (as et.fit does): the Linears split, the attention run on
    a share of its heads; a tensor cell that split nothing would equal serial trivially."""
    from exatrain.mesh import init
    from exatrain.parallel.tensor import parallelize_tensor
    from exatrain.plan import Plan
    from user_models import build

    from exatrain.parallel.reads import mark_reads_outside, reads_outside
    from exatrain.workloads.user import uncompiled
    from user_models import dataset

    mesh = init(Plan(**PLANS[plan]))
    try:
        plain = uncompiled(build(model))[0]
        samples = dataset(model)   # the first two samples' inputs (one tensor, or several)
        collate = COLLATE.get(model, torch.utils.data.default_collate)
        inputs = collate([samples[i] for i in range(2)])[0]
        mark_reads_outside(plain, reads_outside(plain, inputs))
        laid_out = parallelize_tensor(plain, mesh).exatrain_tensor.summary()
        return {k: laid_out[k] for k in ("split", "local_heads")}
    finally:
        mesh.close()


def _param(cell):
    marks = [pytest.mark.xfail(strict=True, reason=XFAIL[cell])] if cell in XFAIL else []
    return pytest.param(cell, id=f"{cell[0]}-{cell[1]}", marks=marks)


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory):
    """(model, plan) -> every rank's result, trained in one pool job per world size over the
    cells this session selected."""
    selected = {item.callspec.params["cell"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    runs: dict = {}
    by_world: dict[int, list] = {}
    for cell in CELLS:
        if cell in selected:
            by_world.setdefault(world(cell[1]), []).append(cell)

    def get(cell):
        size = world(cell[1])
        if cell not in runs:
            before = torch.get_num_threads()
            out = run_ranks(size, train_cells, by_world[size],
                            str(tmp_path_factory.mktemp(f"world{size}")))
            torch.set_num_threads(before)
            for c in by_world[size]:
                runs[c] = [rank[c] for rank in out]
        return runs[cell]
    return get


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    """model -> `et.fit` of it on one process (this one), trained once."""
    done: dict = {}
    root = tmp_path_factory.mktemp("serial")

    def get(model):
        if model not in done:
            from user_models import fit
            done[model] = fit(model, {}, str(root / model))
        return done[model]
    return get


@pytest.mark.parametrize("cell", [_param(c) for c in CELLS])
def test_users_model_trains_under_the_plan_as_one_process(cell, trained, serial, one_thread):
    model, plan = cell
    runs = trained(cell)
    errors = [run["error"] for run in runs if "error" in run]
    assert not errors, f"{model} under {PLANS[plan]}: {errors[0]}"
    reference = serial(model)
    try:   # the measured differences, printed whether or not the check passes
        state, want = runs[0]["state"], reference["state"]
        keys = sorted(k for k in want if not k.endswith("num_batches_tracked"))
        flat = torch.cat([state[k].double().flatten() for k in keys])
        ref = torch.cat([want[k].double().flatten() for k in keys])
        losses = torch.tensor([list(r["losses"].values()) for r in runs], dtype=torch.float64)
        ref_losses = torch.tensor(list(reference["losses"].values()), dtype=torch.float64)
        print(f"\n{model} {plan}: weights {float((flat - ref).norm() / ref.norm()):.2e} "
              f"losses {float(((losses - ref_losses).abs() / ref_losses.abs()).max()):.2e}")
    except Exception as exc:  # noqa: BLE001
        print(f"\n{model} {plan}: not comparable ({exc})")
    check(model, PLANS[plan], reference, runs)
    if model == "mlp_f64":   # float64 throughout: equal to one process to float64's digits
        assert float((flat - ref).norm() / ref.norm()) <= 1e-12, (plan, "weights")
        assert float(((losses - ref_losses).abs() / ref_losses.abs()).max()) <= 1e-12, plan
    # every axis of the plan was in use: it moved bytes each step (the ledger's own key)
    moved = runs[0]["bytes_per_step"]
    print(f"  {runs[0]['plan']}: bytes per step {moved}")
    for axis in (a for a in PLANS[plan] if a != "parallel"):
        assert moved.get(axis, 0) > 0, (model, plan, axis, moved)
    if "parallel" in PLANS[plan]:   # the ZeRO stage asked for is the one that ran
        assert runs[0]["zero_stage"] == PLANS[plan]["parallel"]["zero_stage"], \
            (plan, runs[0]["zero_stage"])
    if "tensor" in PLANS[plan]:
        layout = runs[0]["layout"]
        print(f"  tensor layout: {layout}")
        if model == "mlp_tied":   # the weight the decoder reads stays whole
            assert "fc2" in layout["split"] and "fc1" not in layout["split"], layout
        elif model in ("mlp_weightnorm", "mlp_oldweightnorm"):   # normed layers stay whole
            assert layout["split"] == ["out"], layout
        elif model == "cnn_normed":   # the normed convolutions stay whole, the plain one splits
            assert layout["split"] == ["conv3"], layout
        elif model == "fno":   # the 1x1 convolutions channel/filter-split, the Fourier whole
            assert layout["split"] == ["lift", "pointwise.0", "pointwise.1"], layout
        elif model == "cnn_conditioned":   # the Linear of the parameters, the convolutions
            assert layout["split"] == ["film", "conv1", "conv2"], layout
        elif model == "gnn":   # the node-wise Linears; the readout after the pool stays whole
            assert layout["split"] == ["embed", "message", "update"], layout
        elif model == "transformer_torch":   # its layers' fast path reads their Linears whole
            assert layout["split"] == ["embed", "head"], layout
        else:
            assert {"fc1", "fc2"} <= set(layout["split"]) if model.startswith("mlp") else \
                {"blocks.0.mlp.0", "blocks.0.mlp.2", "blocks.1.mlp.0"} <= set(layout["split"]), \
                layout
        if model == "transformer":   # the hand-written attention runs on a share of its heads
            heads = HEADS_OF[model] // PLANS[plan]["tensor"]
            assert layout["local_heads"] == {f"blocks.{i}.attn": {"n_head": heads}
                                             for i in (0, 1)}, layout


class CoarseAndFine(torch.nn.Module):
    """A field and a coarser field beside it (its spatial dims another size)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 1, 3, padding=1)

    def forward(self, fine, coarse):
        up = torch.nn.functional.interpolate(coarse, size=fine.shape[2:])
        return self.conv(torch.cat([fine, up], dim=1))


def _several_inputs_refused(out_dir: str) -> dict:
    import exatrain as et
    from exatrain.mesh import init
    from exatrain.parallel import parallelize
    from user_models import fit

    found = {}
    mesh = init(et.Plan(space=(1, 2, 1)))
    try:
        parallelize(CoarseAndFine(), mesh, whole_samples=True)(torch.randn(2, 2, 16, 16),
                                                               torch.randn(2, 1, 8, 8))
        found["sizes"] = ""
    except Exception as exc:  # noqa: BLE001 - the message is the result
        found["sizes"] = f"{type(exc).__name__}: {exc}"
    finally:
        mesh.close()
    for model, plan in (("mlp_keywords", "pipe2"), ("cnn_conditioned", "space121")):
        try:
            fit(model, PLANS[plan], os.path.join(out_dir, f"{model}-{plan}"))
            found[plan] = ""
        except Exception as exc:  # noqa: BLE001 - the message is the result
            found[plan] = f"{type(exc).__name__}: {exc}"
    return found


def test_several_inputs_are_refused_by_name_where_they_cannot_go(tmp_path, one_thread):
    """pipe's stages pass one tensor on; under space a dense layer on a per-sample input cannot
    tell whether its gradient is a block's share or whole, and inputs of two spatial sizes
    cannot be cut into matching blocks; the planner models one input."""
    import exatrain as et
    from exatrain.errors import ArgumentError
    from user_models import build

    for found in run_ranks(2, _several_inputs_refused, str(tmp_path)):
        for words in ("DataError: Plan(pipe=2): the model takes several inputs, and pipe's "
                      "stages pass one tensor", "use a Plan without pipe"):
            assert words in found["pipe2"], found["pipe2"]
        for words in ("SpatialSplitError", "layer 'film' (Linear)", "per-sample input",
                      "broadcast that input over the field as channels",
                      "nn.Conv of kernel size 1"):
            assert words in found["space121"], found["space121"]
        for words in ("SpatialSplitError", "spatial dims of two sizes, [16, 16] and [8, 8]",
                      "space=(1, 1, 1)"):
            assert words in found["sizes"], found["sizes"]
    with pytest.raises(ArgumentError, match="models a model of one input; example is a tuple"):
        et.plans(build("cnn_conditioned"), (torch.zeros(1, 2, 16, 16), torch.zeros(1, 3)),
                 world=2, batch=4)


def _graphs_refused(out_dir: str) -> dict:
    from user_models import fit

    found = {}
    for plan in ("pipe2", "space121", "kfac"):
        try:
            if plan == "kfac":
                fit("gnn", {"data": 2, "optim": "kfac"}, os.path.join(out_dir, plan))
            else:
                fit("gnn", PLANS[plan], os.path.join(out_dir, plan))
            found[plan] = ""
        except Exception as exc:  # noqa: BLE001 - the message is the result
            found[plan] = f"{type(exc).__name__}: {exc}"
    return found


def test_a_collate_fn_is_refused_by_name_where_its_batches_cannot_go(tmp_path, one_thread):
    """Pipeline micro-batches and spatial blocks cut every input along one dim, which a batch of
    graphs (nodes concatenated) does not allow, and K-FAC counts a layer's input rows as
    samples; a target with a row per node, not per sample, would be counted as samples by
    evaluation."""
    import exatrain as et
    import torch.nn.functional as F
    from user_models import build, collate_graphs, dataset

    for found in run_ranks(2, _graphs_refused, str(tmp_path)):
        for plan, words in (("pipe2", "pipe=2 cuts every input into micro-batches"),
                            ("space121", "space=(1, 2, 1) cuts every input into spatial blocks"),
                            ("kfac", "optim.name='kfac' counts a layer's input rows")):
            assert found[plan].startswith("DataError: Plan("), found[plan]
            for word in ("a collate_fn's batches (graphs of different sizes) have no dim", words,
                         "Data, shard and 1D tensor parallelism (plan.tensor=N) train them"):
                assert word in found[plan], found[plan]

    def per_node(samples):   # a target for every atom
        (nodes, edges, graph), _ = collate_graphs(samples)
        return (nodes, edges, graph), nodes[:, :1]

    with pytest.raises(et.DataError, match=r"collate_fn on train_set\[0:2\] returned a target "
                       r"Tensor \(\d+, 1\) float32: .* one row per sample \(2 here\)"):
        et.fit(lambda: build("gnn"), dataset("gnn"), dataset("gnn"), loss=F.mse_loss,
               collate_fn=per_node, train={"steps": 1, "batch_size": 4, "num_workers": 0},
               run={"out_dir": str(tmp_path / "node")})

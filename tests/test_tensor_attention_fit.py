"""Attention as people write it, trained with `et.fit` under `tensor`, equal to one process.

Two modules in one small model, written the way their authors write them:

* a hand-written attention with `self.n_head` and an integer `self.head_dim`, reshaping with
  `view(b, t, -1, self.head_dim)` and building its causal mask with `torch.ones(t, t).tril()`
  (no `device=`), with an older `c // self.n_head` reshape left in a branch it does not take.
  q/k/v -> proj is split as a column -> row pair, by heads. (Before: the check of the forward
  on the meta device failed on the CPU mask, fell back to reading the source, and died in its
  own refusal with `TypeError: unsupported operand type(s) for //: 'int' and 'str'`.)
* nanoGPT's `Block` with its `CausalSelfAttention`, from nanoGPT's model.py (fused `c_attn`
  split by `n_embd`, `view(B, T, self.n_head, C // self.n_head)`, flash SDPA; and the path
  taken where SDPA is missing: the registered `bias` tril buffer). Its c_attn (C -> 3C) does not
  chain into c_proj (C -> C), so its Linears are split one at a time and it trains unchanged.

`et.fit` on 2 ranks (Plan(tensor=2)) and on 4 (Plan(data=2, tensor=2)) against `et.fit` on one
rank: the logged losses of 3 SGD steps, and every weight of the final checkpoint, read whole.
Tolerance: fp32, relative 1e-5 (measured: losses equal, weights ≤ 2.2e-7; the split matrix
multiplies reorder sums). The key projections' biases get a gradient that is zero up to rounding
(softmax ignores a per-query shift), so they are compared in absolute terms (1e-6; measured
1.5e-8).

The refusal path itself (a forward that cannot run on a share of the heads, and one that cannot
be run at all and is judged from its source) is checked in one process: a TensorSplitError that
names the module, the spelling and the fix.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import rel_err, run_ranks

TOL = 1e-5
WIDTH, HEADS, T = 16, 4, 8


class Attention(nn.Module):
    def __init__(self, dim, n_head, legacy=False):
        super().__init__()
        self.n_head = n_head
        self.head_dim = dim // n_head
        self.legacy = legacy
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        if self.legacy:
            q = self.query(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            k = self.key(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            v = self.value(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        else:
            q = self.query(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            k = self.key(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            v = self.value(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(t, t).tril()
        att = att.masked_fill(mask == 0, float("-inf"))
        att = att.softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, -1)
        return self.proj(y)


class UserBlock(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_head)

    def forward(self, x):
        return x + self.attn(self.norm(x))


# ---------------------------------------------------------------- nanoGPT's model.py, as written
class GPTConfig:
    block_size: int = T
    n_embd: int = WIDTH
    n_head: int = HEADS
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """ LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False """

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # flash attention make GPU go brrrrr but support is only in PyTorch >= 2.0
        self.flash = hasattr(torch.nn.functional, 'scaled_dot_product_attention')
        if not self.flash:
            print("WARNING: using slow attention. Flash Attention requires PyTorch >= 2.0")
            # causal mask to ensure that attention is only applied to the left in the input sequence
            self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                                 .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
        if self.flash:
            # efficient attention using Flash Attention CUDA kernels
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                is_causal=True)
        else:
            # manual implementation of attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x
# ---------------------------------------------------------------- end of nanoGPT's code


def slow_block() -> Block:
    """nanoGPT's Block on the path it takes where SDPA is missing (torch < 2.0): the manual
    attention with its registered `bias` mask, set up as its __init__ does on that path."""
    block = Block(GPTConfig())
    attn = block.attn
    attn.flash = False
    attn.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))
    return block


def make_model() -> nn.Module:
    return nn.Sequential(UserBlock(WIDTH, HEADS), Block(GPTConfig()), slow_block())


def fit_blocks(plan: dict, out_dir: str) -> dict:
    """One rank of `et.fit` on the model above; the logged losses and, on rank 0, the final
    checkpoint's weights read whole."""
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    import exatrain as et
    from exatrain.train.checkpoints.checkpoint import full_model_state, latest
    from harness import logged_losses

    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, T, WIDTH, generator=g)
    y = x.roll(1, dims=1) + 0.1 * torch.randn(x.shape, generator=g)
    train, val = TensorDataset(x[:16], y[:16]), TensorDataset(x[16:], y[16:])
    summary = et.fit(make_model, train, val, loss=F.mse_loss, plan=et.Plan(**plan),
                     train={"steps": 3, "batch_size": 8, "log_every": 1, "eval_every": 3,
                            "num_workers": 0},
                     optim={"name": "sgd", "lr": 0.1}, schedule={"warmup_steps": 0},
                     run={"out_dir": out_dir})
    rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"])
    out = {"losses": logged_losses(summary["run_dir"]), "val_loss": summary["val_loss"]}
    if rank == 0:
        out["state"] = full_model_state(latest(summary["run_dir"]))
    if plan:   # how the same model was laid out: which attention split by heads, which not
        from exatrain.mesh import init
        from exatrain.parallel.tensor import parallelize_tensor

        mesh = init(et.Plan(**plan))
        try:
            laid_out = parallelize_tensor(make_model(), mesh).exatrain_tensor.summary()
            out["layout"] = {k: laid_out[k] for k in ("chained", "local_heads", "split")}
        finally:
            mesh.close()
    return out


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    return run_ranks(1, fit_blocks, {}, str(tmp_path_factory.mktemp("serial")))[0]


@pytest.mark.parametrize("plan", [{"tensor": 2}, {"data": 2, "tensor": 2}],
                         ids=["tensor2", "data2-tensor2"])
def test_attention_as_written_trains_like_serial_under_tensor(plan, serial, tmp_path):
    ranks = run_ranks(2 * plan.get("data", 1), fit_blocks, plan, str(tmp_path))
    for r in ranks:
        assert r["losses"].keys() == serial["losses"].keys() == {1, 2, 3}
        losses = torch.tensor([r["losses"][s] for s in (1, 2, 3)])
        expected = torch.tensor([serial["losses"][s] for s in (1, 2, 3)])
        assert rel_err(losses, expected) <= TOL, (losses, expected)
        assert r["val_loss"] == pytest.approx(serial["val_loss"], rel=TOL)
    state, want = ranks[0]["state"], serial["state"]
    assert state.keys() == want.keys()
    for name, tensor in want.items():
        if name.endswith("key.bias") or name.endswith("c_attn.bias"):
            # the key bias moves by rounding only (its gradient is zero in exact arithmetic)
            assert (state[name] - tensor).abs().max() <= 1e-6, name
        else:
            assert rel_err(state[name], tensor) <= TOL, (name, rel_err(state[name], tensor))
    layout = ranks[0]["layout"]
    # the user's attention went the heads road (a q/k/v -> proj pair, 2 of 4 heads a rank);
    # nanoGPT's Linears were split one at a time (its c_attn does not chain into c_proj)
    assert layout["chained"] == ["0.attn", "1.mlp", "2.mlp"], layout
    assert layout["local_heads"] == {"0.attn": {"n_head": 2}}, layout
    assert {"1.attn.c_attn", "1.attn.c_proj", "2.attn.c_attn"} <= set(layout["split"]), layout
    moved = (state["0.attn.query.weight"] - make_initial()["0.attn.query.weight"]).abs().max()
    assert moved > 1e-4   # the split pair trained


def make_initial() -> dict:
    from exatrain.train.config import RunOptions

    torch.manual_seed(RunOptions().seed)   # as et.fit seeds before calling make_model
    return make_model().state_dict()


# ---------------------------------------------------------------- the refusal, in one process
class NeedsFrequencies(Attention):
    """A forward that needs more than the input (rotary frequencies) and reads the full width:
    it cannot be run on a (2, 4, width) trial input, so it is judged from its source."""

    def forward(self, x, freqs):
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2) * freqs
                   for p in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def test_the_refusal_names_the_module_the_spelling_and_the_fix():
    from exatrain.errors import TensorSplitError, UserError
    from exatrain.parallel.tensor.heads import check_forward, runs_on_local_heads

    qkv = ["query", "key", "value"]
    # the device-less mask cannot meet meta tensors; the trial runs again on real CPU ones
    assert runs_on_local_heads(Attention(WIDTH, HEADS), 2, qkv, "proj") is None
    assert runs_on_local_heads(Attention(WIDTH, HEADS, legacy=True), 2, qkv, "proj") is not None
    for module, how in ((Attention(WIDTH, HEADS, legacy=True), "it fails"),
                        (NeedsFrequencies(WIDTH, HEADS), None)):
        with pytest.raises(TensorSplitError) as caught:
            check_forward("blocks.0.attn", module, 2, "tensor", qkv, "proj")
        text = str(caught.value)
        assert isinstance(caught.value, UserError)
        assert f"'blocks.0.attn' ({type(module).__name__})" in text
        assert "with tensor=2 each rank holds 2 of its 4 heads" in text
        assert "`c // self.n_head`" in text
        assert "self.head_dim = n_embd // n_head" in text and "pairs=False" in text
        assert (how in text) if how else "it fails" not in text
    # the trial leaves the module and the caller's random stream as they were
    module = Attention(WIDTH, HEADS)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    torch.manual_seed(5)
    check_forward("attn", module, 2, "tensor", qkv, "proj")
    drawn = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3))
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert module.n_head == HEADS

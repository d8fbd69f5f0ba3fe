"""Easy mode under tensor for attention written the usual ways, and dropout that leaves the
user's random stream alone.

A 2-rank launch (tensor=2) and a 4-rank one (tensor=(2, 1, 2)): HF-style (`num_heads`,
`head_dim`, `view(B, T, self.num_heads, self.head_dim)`), torchtitan-style (`n_heads`,
`n_kv_heads`, `view(bs, seqlen, -1, self.head_dim)`) and nanoGPT-style with a `head_dim`
(`view(B, T, self.n_head, self.head_dim)`) attention, and one with `c // self.n_head` in a branch
it never takes, train like serial (outputs, gradients, 3 SGD
steps; fp32 rel ≤ 1e-5) with q/k/v/out split as a pair and the head-count attributes set to the
local count; nanoGPT's fused attention as written there trains like serial with its Linears split
one at a time. On 2 ranks: the spelling `C // self.n_head` (with q/k/v split by heads) and a
full-width reshape `view(B, T, self.hidden_size)` are refused when the model is parallelized,
naming the module, the attribute and the fix; with dropout (nn.Dropout and SDPA's dropout_p) a
training forward + backward leaves the global RNG state exactly as it was, both tensor ranks draw
the same masks, successive forwards draw new ones, and activation checkpointing replays the
forward's masks in the recomputation.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from exatrain.plan import Plan
from harness import rel_err, run_ranks

TOL = 1e-5
WIDTH, HEADS = 16, 4


class HFAttention(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.hidden_size, self.num_heads = WIDTH, HEADS
        self.head_dim = WIDTH // HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.o_proj = nn.Linear(WIDTH, WIDTH)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        bsz, q_len, _ = x.size()
        q, k, v = (p(x).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dropout(self.o_proj(y.transpose(1, 2).reshape(bsz, q_len, -1)))


class TitanAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = HEADS, HEADS, WIDTH // HEADS
        self.n_rep = self.n_heads // self.n_kv_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))

    def forward(self, x):
        bs, seqlen, _ = x.shape
        xq, xk, xv = (w(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
                      for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class NanoAttention(nn.Module):
    """nanoGPT's attention with separate q/k/v and the head size kept in `head_dim`."""

    def __init__(self):
        super().__init__()
        self.n_head, self.n_embd, self.head_dim = HEADS, WIDTH, WIDTH // HEADS
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.c_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        B, T, C = x.size()
        # self.head_dim, not C // self.n_head: split by heads, n_head is the local count
        # (this comment must not be mistaken for code by the check)
        q, k, v = (p(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class BranchAttention(nn.Module):
    """Attention as users write it: an integer head_dim, `view(b, t, -1, self.head_dim)`, and
    `c // self.n_head` in a branch this module never takes (source text is not what it does)."""

    def __init__(self, legacy_reshape=False):
        super().__init__()
        self.n_head, self.head_dim, self.legacy_reshape = HEADS, WIDTH // HEADS, legacy_reshape
        self.query, self.key, self.value = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        b, t, c = x.shape
        if self.legacy_reshape:   # never taken here
            q, k, v = (p(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                       for p in (self.query, self.key, self.value))
        else:
            q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                       for p in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class NanoFused(nn.Module):
    """nanoGPT's attention as written there: one fused q/k/v Linear, the head size from the
    input's width. Its Linears do not chain (3C → C), so each is split on its own."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = HEADS, WIDTH, dropout
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(self.n_embd, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class NanoOriginal(NanoAttention):
    """nanoGPT's own spelling: the head size from the full width read off the input."""

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (p(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class FullWidthReshape(HFAttention):
    """Older HF spelling: the output reshaped to self.hidden_size."""

    def forward(self, x):
        bsz, q_len, _ = x.size()
        q, k, v = (p(x).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(bsz, q_len, self.hidden_size))


class Block(nn.Module):
    def __init__(self, attention: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = attention

    def forward(self, x):
        return x + self.attn(self.norm(x))


class _Stack(nn.Module):
    """Two dropout attention blocks in an nn.ModuleList (what activation checkpointing wraps)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(HFAttention(dropout=0.5)) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class NanoBlock(nn.Module):
    """A transformer block with fused nanoGPT attention and an MLP (a pair)."""

    def __init__(self):
        super().__init__()
        self.attn = Block(NanoFused())
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                 nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x):
        x = self.attn(x)
        return x + self.mlp(x)


class NanoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(NanoBlock() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


ATTENTIONS = {"hf": HFAttention, "titan": TitanAttention, "nanogpt": NanoAttention,
              "nanogpt_fused": NanoFused, "branch": BranchAttention}
REFUSED = {"nanogpt_original": NanoOriginal, "full_width_reshape": FullWidthReshape}


def compare_spellings(mesh) -> dict:
    """Each of ATTENTIONS in a block, parallelized on `mesh`, against the serial block."""
    from exatrain.parallel.tensor import parallelize_tensor
    from exatrain.parallel.tensor.heads import head_count_attrs
    from exatrain.parallel.tensor.state import gather_full, layout_of

    out: dict = {"errs": {}, "local_heads": {}, "chained": {}}
    for name, cls in ATTENTIONS.items():
        torch.manual_seed(1)
        serial = Block(cls())
        plain = copy.deepcopy(serial)
        par = parallelize_tensor(plain, mesh)
        out.setdefault("plain_untouched", []).append(head_count_attrs(plain.attn))
        summary = par.exatrain_tensor.summary()
        out["local_heads"][name] = summary["local_heads"]
        out["chained"][name] = summary["chained"]
        out.setdefault("split", {})[name] = summary["split"]
        x = torch.randn(3, 6, WIDTH)
        xs, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        ys, yp = serial(xs), par(xp)
        weights = torch.randn_like(ys)
        (ys * weights).sum().backward()
        (yp * weights).sum().backward()
        errs = {"out": rel_err(yp, ys), "dx": rel_err(xp.grad, xs.grad)}
        grads = {n: gather_full(p.grad, layout_of(p)) for n, p in par.named_parameters()}
        for n, p in serial.named_parameters():
            # the key bias's gradient is zero up to rounding (softmax ignores a shift of the
            # scores per query): compare such gradients in absolute terms
            errs[f"grad.{n}"] = rel_err(grads[n], p.grad) if p.grad.abs().max() > 1e-4 \
                else float((grads[n] - p.grad).abs().max())
        # three SGD steps on one batch: the losses follow the serial ones
        opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
        opt_p = torch.optim.SGD(par.parameters(), lr=0.1)
        for step in range(3):
            for model, opt, tag in ((serial, opt_s, "s"), (par, opt_p, "p")):
                opt.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                errs.setdefault(f"loss{step}", {})[tag] = loss.detach()
            pair = errs.pop(f"loss{step}")
            errs[f"loss{step}"] = rel_err(pair["p"], pair["s"])
        out["errs"][name] = errs
    return out


def spellings_3d(_unused) -> dict:
    from exatrain.mesh import init
    return compare_spellings(init(Plan(tensor=(2, 1, 2))))


def easy_mode(_unused) -> dict:
    from exatrain.mesh import init
    from exatrain.parallel.tensor import parallelize_tensor

    mesh = init(Plan(tensor=2))
    out = {**compare_spellings(mesh), "refusals": {}}
    for name, cls in REFUSED.items():
        torch.manual_seed(1)
        try:
            parallelize_tensor(Block(cls()), mesh)
            out["refusals"][name] = ""
        except ValueError as exc:
            out["refusals"][name] = str(exc)

    # sequence parallelism must not split the tokens of attention it cannot pair
    from exatrain.parallel.options import ParallelOptions
    torch.manual_seed(1)
    try:
        parallelize_tensor(NanoBlocks(), mesh, ParallelOptions(sequence_parallel=True))
        out["refusals"]["sequence_parallel"] = ""
    except ValueError as exc:
        out["refusals"]["sequence_parallel"] = str(exc)

    # dropout: exatrain's stream inside the forward, the user's stream untouched
    torch.manual_seed(7)
    # (nn.Dropout modules, and SDPA's functional dropout_p in the fused nanoGPT block)
    model = parallelize_tensor(nn.Sequential(Block(HFAttention(dropout=0.5)),
                                             Block(NanoFused(dropout=0.5)), nn.Dropout(0.5)), mesh)
    x = torch.randn(2, 4, WIDTH)
    torch.manual_seed(11)                      # the user's stream, e.g. for augmentation
    before = torch.get_rng_state()
    first = model(x)
    first.sum().backward()
    untouched = torch.equal(torch.get_rng_state(), before)
    second = model(x)
    serial_draw = torch.rand(5)                # what the user's next draw is
    torch.manual_seed(11)
    expected_draw = torch.rand(5)
    # activation checkpointing replays the forward's masks in the backward: same gradients
    from exatrain.parallel.options import ParallelOptions
    grads = []
    for mode in ("none", "full"):
        torch.manual_seed(7)
        checkpointed = parallelize_tensor(
            _Stack(), mesh, ParallelOptions(activation_checkpointing=mode))
        torch.manual_seed(11)
        checkpointed(x).square().sum().backward()
        grads.append([p.grad.clone() for p in checkpointed.parameters()])
    out["recompute_err"] = max(rel_err(a, b) for a, b in zip(*grads))
    return {**out, "rng_untouched": untouched, "next_draw_equal": torch.equal(serial_draw, expected_draw),
            "first": first.detach(), "second": second.detach()}


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, easy_mode, None)


@pytest.fixture(scope="module")
def results_3d():
    return run_ranks(4, spellings_3d, None)


def test_usual_attention_spellings_train_like_serial(results, results_3d):
    for rank, result in enumerate(results + results_3d):
        for name, errs in result["errs"].items():
            worst = max(errs.values())
            assert worst <= TOL, f"rank {rank} {name}: {errs}"
        assert result["chained"] == {**{n: ["attn"] for n in ATTENTIONS}, "nanogpt_fused": []}
        assert result["split"]["nanogpt_fused"] == ["attn.c_attn", "attn.c_proj"]
    # 1D: heads / tensor; 3D (2, 1, 2): heads / tensor_x
    assert results[0]["local_heads"] == results_3d[0]["local_heads"] == {"hf": {"attn": {"num_heads": 2}},
                                         "titan": {"attn": {"n_heads": 2, "n_kv_heads": 2}},
                                         "nanogpt": {"attn": {"n_head": 2}},
                                         "nanogpt_fused": {},
                                         "branch": {"attn": {"n_head": 2}}}
    # the user's model keeps its own head counts (easy mode works on a copy of the tree)
    assert results[0]["plain_untouched"] == [{"num_heads": 4}, {"n_heads": 4, "n_kv_heads": 4},
                                             {"n_head": 4}, {"n_head": 4}, {"n_head": 4}]


def test_heads_are_judged_by_running_the_forward_not_by_its_source():
    """One process, meta device: the branch it never takes is not held against it; the same
    module taking that branch, and nanoGPT's own spelling, fail when run on a share of heads."""
    from exatrain.parallel.tensor.heads import check_forward, runs_on_local_heads

    qkv = ["query", "key", "value"]
    assert runs_on_local_heads(BranchAttention(), 2, qkv, "proj") is None
    check_forward("attn", BranchAttention(), 2, "tensor", qkv, "proj")   # accepted
    with pytest.raises(ValueError,
                       match=r"'attn' \(BranchAttention\).*c // self.n_head.*share of the heads, it fails"):
        check_forward("attn", BranchAttention(legacy_reshape=True), 2, "tensor", qkv, "proj")
    with pytest.raises(ValueError, match=r"C // self.n_head.*self.head_dim"):
        check_forward("attn", NanoOriginal(), 2, "tensor", ["q", "k", "v"], "c_proj")
    with pytest.raises(ValueError, match=r"self.hidden_size.*view\(B, T, -1\)"):
        check_forward("attn", FullWidthReshape(), 2, "tensor",
                      ["q_proj", "k_proj", "v_proj"], "o_proj")
    assert all(p.device.type == "cpu" for p in BranchAttention().parameters())


def test_spellings_that_cannot_split_are_refused_with_the_fix(results):
    refusals = results[0]["refusals"]
    nano = refusals["nanogpt_original"]
    assert "'attn'" in nano and "NanoOriginal" in nano and "C // self.n_head" in nano
    assert "self.head_dim" in nano and "pairs=False" in nano
    assert "each rank holds 2 of its 4 heads" in nano
    sp = refusals["sequence_parallel"]
    assert "attn.attn (NanoFused)" in sp and "sequence_parallel=false" in sp
    full = refusals["full_width_reshape"]
    assert "self.hidden_size" in full and "view(B, T, -1)" in full and "'attn'" in full


def test_dropout_leaves_the_user_stream_and_agrees_over_the_group(results):
    for result in results:
        assert result["rng_untouched"] and result["next_draw_equal"]
    # replicated activations: the same masks on both tensor ranks
    assert torch.equal(results[0]["first"], results[1]["first"])
    assert torch.equal(results[0]["second"], results[1]["second"])
    # activation checkpointing recomputes with the forward's masks
    assert results[0]["recompute_err"] <= TOL, results[0]["recompute_err"]
    # dropout is active, and a second forward draws new masks
    assert (results[0]["first"] == 0).any()
    assert not torch.equal(results[0]["first"], results[0]["second"])


def test_forward_seeds_follow_the_users_seed_not_the_process_history():
    from exatrain.parallel.tensor.rng import ForwardRng

    original = ForwardRng()
    torch.manual_seed(3)
    step3 = [original.next_seed() for _ in range(2)]     # two micro-batches of one step
    torch.manual_seed(4)
    step4 = original.next_seed()
    assert step3[0] != step3[1] and step4 not in step3
    resumed = ForwardRng()                                # a new process resuming at step 4
    torch.manual_seed(4)
    assert resumed.next_seed() == step4


def test_a_forward_that_raised_still_gives_the_user_state_back():
    from exatrain.parallel.tensor.rng import ForwardRng

    rng = ForwardRng()
    torch.manual_seed(11)
    user = torch.get_rng_state()
    rng.enter(123)               # the forward raises: no exit
    torch.rand(3)
    rng.enter(456)               # the next forward starts
    rng.exit()
    assert torch.equal(torch.get_rng_state(), user)

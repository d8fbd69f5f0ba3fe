"""Full-weight state dicts and checkpoints of tensor-parallel models.

* A plain GPT's state dict loads into a 3D (and a 1D) grid: the parallel model then computes the
  plain model's logits, and saving back gives the same tensors bit for bit.
* A model built on the meta device is split before any memory is allocated: each rank allocates
  only its parts, and the full weights load into them.
* `dtensor_state_dict` / `for_checkpoint` make model and optimizer state saveable with
  torch.distributed.checkpoint: a checkpoint written on the (2,1,2) grid loads exactly into the
  plain model on one process and into a tensor=4 model (in place, through the DTensor views).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed.checkpoint as dcp

from exatrain.models.gpt import GPT, GPTConfig, gpt_loss
from harness import rel_err, run_ranks

SHAPE = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


def load_run_save(degrees_list, checkpoint_dir: str) -> dict:
    from exatrain.mesh import init
    from exatrain.parallel.tensor import parallelize_tensor
    from exatrain.parallel.tensor.state import (dtensor_state_dict, full_state_dict,
                                                load_full_state_dict)
    from exatrain.plan import Plan

    out = {}
    for degrees in degrees_list:
        mesh = init(Plan(**degrees))
        torch.manual_seed(0)
        plain = GPT(GPTConfig(**SHAPE))
        if degrees == degrees_list[0]:
            torch.manual_seed(1)                       # other weights: loading must overwrite
            par = parallelize_tensor(GPT(GPTConfig(**SHAPE)), mesh)
        else:                                          # never allocated whole: built on meta
            with torch.device("meta"):
                par = parallelize_tensor(GPT(GPTConfig(**SHAPE)), mesh)
            assert not any(p.is_meta for p in par.parameters())
            result_local = sum(p.numel() for p in par.parameters())
        full = {k: v.clone() for k, v in plain.state_dict().items()}
        load_full_state_dict(par, full)
        tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(2))
        par.eval(), plain.eval()
        with torch.no_grad():
            err = rel_err(par(tokens), plain(tokens))
        back = full_state_dict(par)
        exact = back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
        result = {"logits_err": err, "exact": exact}
        if degrees != degrees_list[0]:
            result["local_numel"] = result_local
        if degrees == degrees_list[0]:
            # one optimizer step, then a DCP checkpoint of model and optimizer state
            par.train()
            optim = torch.optim.AdamW(par.parameters(), lr=1e-3)
            gpt_loss(par(tokens), tokens.roll(1, 1)).backward()
            optim.step()
            names = {id(p): n for n, p in par.named_parameters()}
            moments = {names[id(p)]: s["exp_avg"] for p, s in optim.state.items()}
            state = {"model": dtensor_state_dict(par, par.state_dict(), mesh),
                     "exp_avg": dtensor_state_dict(par, moments, mesh)}
            dcp.save(state, checkpoint_id=checkpoint_dir)
            result["full_after_step"] = full_state_dict(par)
            from exatrain.parallel.tensor.state import gather_full, layout_of
            params = dict(par.named_parameters())
            result["exp_avg"] = {k: gather_full(v, layout_of(params[k])).cpu()
                                 for k, v in moments.items()}
        else:
            # resume on another grid: the (2,1,2) checkpoint loads into this tensor=4 model
            from exatrain.parallel.tensor.state import for_checkpoint
            local = par.state_dict()
            dcp.load({"model": for_checkpoint(par, local)}, checkpoint_id=checkpoint_dir)
            result["resumed"] = full_state_dict(par)
        out[str(mesh.plan)] = result
    return out


def test_full_state_into_grids_and_dcp_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    results = run_ranks(4, load_run_save, [dict(tensor=(2, 1, 2)), dict(tensor=4)], ckpt)
    for per_rank in results:
        for plan, r in per_rank.items():
            assert r["logits_err"] <= 1e-5, (plan, r["logits_err"])
            assert r["exact"], plan
    plain_numel = GPT(GPTConfig(**SHAPE)).num_params()
    local = results[0]["Plan(tensor=4)"]["local_numel"]
    assert local < 0.45 * plain_numel, (local, plain_numel)   # blocks and lm_head split 4 ways
    # the sharded checkpoint loads into the plain model on one process, exactly
    first = results[0]["Plan(tensor=(2, 1, 2))"]
    plain = GPT(GPTConfig(**SHAPE))
    target = {"model": copy.deepcopy(plain.state_dict()),
              "exp_avg": {k: torch.zeros_like(v) for k, v in plain.named_parameters()}}
    dcp.load(target, checkpoint_id=ckpt, no_dist=True)
    for key, value in first["full_after_step"].items():
        assert torch.equal(target["model"][key], value), key
    for key, value in first["exp_avg"].items():
        assert torch.equal(target["exp_avg"][key], value), key
    # ... and into another grid, every rank getting its own parts
    for per_rank in results:
        resumed = per_rank["Plan(tensor=4)"]["resumed"]
        for key, value in first["full_after_step"].items():
            assert torch.equal(resumed[key], value), key

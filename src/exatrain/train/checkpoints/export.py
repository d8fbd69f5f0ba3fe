"""Export a run's model as one unsharded safetensors file; start a run from such a file.

`export_run(RUN_DIR, OUT)`: reads the newest (or a given) checkpoint on one process, with no
process group (`load_weights(RUN_DIR)`, `et.load_weights`, gives the same tensors in memory). Checkpoints store every parameter under its plain-model name -- tensor-parallel
parts as DTensors over the full shape, ZeRO/FSDP shards as Shard(0) DTensors, spatial and data
parallel weights whole -- so DCP reassembles the full tensors whatever Plan wrote them, and the
file equals the one a serial run writes. The manifest is verified first (`checkpoint.verify`).

`load_initial_weights(model, path)` (`model.init_from`): a `.safetensors` file, or a PyTorch state
dict read with `torch.load(weights_only=True)` (tensors and containers only: no pickled code
runs). A state dict wrapped as {"model": {...}} or {"state_dict": {...}} is unwrapped. Missing or
unexpected keys and shape mismatches are refused by name.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from . import checkpoint
from ...errors import UserError


class InitFromError(UserError, ValueError):
    """`model.init_from` names a file that does not exist or whose weights do not fit the model.

    What to do: point it at weights exported from a run of the same model
    (`exatrain export RUN_DIR --out FILE.safetensors`), or build the model with the shapes the
    message names.
    """


def _checkpoint_of(run_dir: str | Path, step: int | None) -> Path:
    run_dir = Path(run_dir)
    path = (checkpoint.checkpoint_dir(run_dir) / f"step_{step:08d}") if step is not None \
        else checkpoint.latest(run_dir)
    if path is None or not path.is_dir():
        raise checkpoint.CheckpointError(f"{run_dir}: no complete checkpoint"
                                         + (f" at step {step}" if step is not None else "") + ".")
    return path


def load_weights(run_dir: str | Path, step: int | None = None) -> dict[str, torch.Tensor]:
    """The trained model's weights from a run directory: the full, unsharded state dict of its
    newest checkpoint (or of `step`), whatever Plan trained it, under your model's own names.

        summary = et.fit(Net, train_set, val_set, loss=F.mse_loss, plan=et.Plan(shard=2))
        model = Net()
        model.load_state_dict(et.load_weights(summary["run_dir"]))

    Read on one process, with no process group, verified against the checkpoint's manifest.
    A model you compiled loads them into its module (`torch.compile(m)`: into `m`)."""
    return checkpoint.full_model_state(_checkpoint_of(run_dir, step))


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None) -> dict:
    from safetensors.torch import save_file

    path = _checkpoint_of(run_dir, step)
    state = checkpoint.full_model_state(path)
    tensors = {key: value.contiguous() for key, value in state.items()
               if isinstance(value, torch.Tensor)}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"exatrain_step": path.name.removeprefix("step_")})
    return {"checkpoint": str(path), "out": str(out), "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise InitFromError(f"model.init_from={path}: no such file.")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise InitFromError(f"model.init_from={path}: not a plain state dict ({exc}).") from None
    for wrapper in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if isinstance(state, dict):   # a compiled model's (torch.compile(m).state_dict()): every key
        state = {".".join(part for part in key.split(".") if part != "_orig_mod"): value
                 for key, value in state.items()}   # under _orig_mod., the module's are the rest
    return state


@torch.no_grad()
def load_initial_weights(model: nn.Module, path: str | Path) -> None:
    state = read_state_dict(path)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise InitFromError(f"model.init_from={path} does not fit the model: missing "
                            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                            f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}.")
    for key, value in state.items():
        if tuple(value.shape) != tuple(own[key].shape):
            raise InitFromError(f"model.init_from={path}: {key} has shape {tuple(value.shape)}, "
                                f"the model's is {tuple(own[key].shape)}.")
    model.load_state_dict(state)

"""A scientist's 3D U-Net with GroupNorm and trilinear upsampling, written as a script and
started the way people start it: `python unet.py` on one process, `exatrain run unet.py --nproc 4`
under `Plan(space=(1, 2, 2))`. The final weights of the two runs (exported from their run
directories) agree within relative 1e-4 in float32 over the whole model (measured: 2.8e-8), and
so do the logged losses (measured: 1.3e-7 at most)."""

import json
import subprocess
import sys

import pytest
import torch

from launched import final_weights

SCRIPT = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import exatrain as et


class UNet(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        def block(cin, cout):
            return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout),
                                 nn.ReLU())
        self.enc, self.down, self.mid = block(2, c), nn.MaxPool3d(2), block(c, 2 * c)
        self.up = nn.Upsample(scale_factor=2, mode="trilinear", align_corners=False)
        self.dec, self.head = block(3 * c, c), nn.Conv3d(c, 1, 1)

    def forward(self, x):
        e = self.enc(x)
        return self.head(self.dec(torch.cat([e, self.up(self.mid(self.down(e)))], dim=1)))


if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(16, 2, 8, 8, 8)
    y = x[:, :1] * 0.5 + x[:, 1:].pow(2) * 0.1
    data = TensorDataset(x, y)
    plan = et.Plan(space=(1, 2, 2)) if "--space" in __import__("sys").argv else None
    et.fit(UNet, data, data, loss=F.mse_loss, plan=plan,
           train={"steps": 4, "batch_size": 4, "log_every": 1, "eval_every": 0,
                  "checkpoint_every": 4},
           optim={"name": "sgd", "lr": 0.05}, run={"out_dir": "runs"})
'''


@pytest.mark.timeout(1500)  # above the two runs' own 600 s each, whose messages say what hung
def test_a_users_groupnorm_trilinear_unet_under_space_1_2_2_via_exatrain_run_is_serial(tmp_path):
    (tmp_path / "unet.py").write_text(SCRIPT)
    runs = {}
    for name, command in {"serial": [sys.executable, "unet.py"],
                          "space": [sys.executable, "-m", "exatrain.cli", "run", "unet.py",
                                    "--nproc", "4", "--", "--space"]}.items():
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        run_dir = max((tmp_path / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
        summary = json.loads((run_dir / "summary.json").read_text())
        losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").open()
                  if '"loss"' in line and '"step"' in line]
        runs[name] = summary, losses, final_weights(run_dir)
    (serial, serial_losses, serial_w), (space, space_losses, space_w) = runs["serial"], runs["space"]
    assert serial["world_size"] == 1 and space["world_size"] == 4
    assert space["plan"] == "Plan(space=(1, 2, 2))"
    assert len(serial_losses) == len(space_losses) == 4 and serial_losses[0] != serial_losses[-1]
    for a, b in zip(space_losses, serial_losses):
        assert abs(a - b) <= 1e-4 * abs(b), (space_losses, serial_losses)
    assert space_w.keys() == serial_w.keys()
    diff = torch.sqrt(sum(((space_w[k] - serial_w[k]).double() ** 2).sum() for k in serial_w))
    norm = torch.sqrt(sum((serial_w[k].double() ** 2).sum() for k in serial_w))
    assert diff / norm < 1e-4, float(diff / norm)

"""Every rank exits cleanly, after success and after a refusal: its exit code (0, or 2 for a
refusal) and nothing on stderr but the run's own console or the refusal's one line, 20 times
under srun (each rank a whole interpreter that exits; of the jobs that train, half `exatrain
run SCRIPT`, half the script itself, whose group `mesh.init` ends at exit) and 20 times under
the local launcher (`exatrain run SCRIPT --nproc 2`, its ranks forked from the forkserver). A C++ thread
still joinable at exit (gloo's, the TCPStore server's) prints `terminate called without an
active exception` and aborts the rank."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from launched import job_env, slurm  # noqa: F401 (slurm: a fixture)

TIMES = 20

# two steps, a loader worker per rank (a worker pool to shut down), a checkpoint, an evaluation
SCRIPT = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import exatrain as et

torch.manual_seed(0)
x = torch.randn(64, 8)
y = x @ torch.randn(8, 1)
et.fit(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)),
       TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:]), loss=F.mse_loss,
       train={"steps": 2, "batch_size": 8, "log_every": 1, "num_workers": 1},
       run={"out_dir": "runs"})
'''

# every fifth job: refused by the Trainer, after the process group is made (7 does not split
# over 2 replicas): exit code 2 and the refusal's one line
REFUSED = SCRIPT.replace('"batch_size": 8', '"batch_size": 7')

# what the run itself prints on stderr (rank 0's console): progress lines, the summary table
# (COLUMNS below keeps rich from wrapping its lines), where the results are; or the refusal
CONSOLE = re.compile(r"^(step \d+|\s*run summary\s*$|[┌│├└]|results: |exatrain run: |"
                     r"exatrain: ConfigError( on rank \d)?: train.batch_size=7 does not split )")


def stray_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not CONSOLE.match(line)]


def test_every_rank_exits_cleanly_under_srun(slurm, tmp_path):
    (tmp_path / "tiny.py").write_text(SCRIPT)
    (tmp_path / "refused.py").write_text(REFUSED)
    env = job_env(COLUMNS="250")
    stray, exits = [], 0
    for i in range(TIMES):
        refused = i % 5 == 4
        rank = ["-m", "exatrain.cli", "run", "refused.py"] if refused else \
            ["-m", "exatrain.cli", "run", "tiny.py"] if i % 2 else ["tiny.py"]
        done = subprocess.run(["srun", "-N", "1", "--ntasks-per-node=2", "--cpus-per-task=1",
                               f"--error=err-{i}-%t.txt", sys.executable, *rank],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        logs = {t: (tmp_path / f"err-{i}-{t}.txt").read_text() for t in (0, 1)}
        assert done.returncode == (2 if refused else 0), \
            f"job {i} ({' '.join(rank)}): {done.stderr}\n{logs}"
        if refused:   # each rank says why, in one line
            assert all(len(log.splitlines()) == 1 for log in logs.values()), logs
        else:         # srun's own report of a task that failed
            assert "error" not in done.stderr, done.stderr
        exits += 2
        stray += [f"job {i} ({' '.join(rank)}) rank {t}: {line}"
                  for t, log in logs.items() for line in stray_lines(log)]
    assert not stray, f"{len(stray)} stray stderr line(s) in {exits} exits:\n" + "\n".join(stray)


@pytest.mark.timeout(1200)  # above the job's own 900 s, whose message says what hung
def test_every_rank_exits_cleanly_under_the_local_launcher(tmp_path):
    """One process launches the job 20 times (the forkserver, which imports torch, starts once);
    `main` returns 0 only where both ranks returned and exited with 0 (`spawn`), 2 for the
    refused job."""
    (tmp_path / "tiny.py").write_text(SCRIPT)
    (tmp_path / "refused.py").write_text(REFUSED)
    scripts = ["refused.py" if i % 5 == 4 else "tiny.py" for i in range(TIMES)]
    driver = ("import sys\nfrom exatrain.cli import main\n"
              f"codes = [main(['run', s, '--nproc', '2']) for s in {scripts!r}]\n"
              "print('codes', *codes)\n")
    done = subprocess.run([sys.executable, "-c", driver], cwd=tmp_path, env=job_env(COLUMNS="250"),
                          capture_output=True, text=True, timeout=900)  # a loaded machine
    assert done.returncode == 0, done.stderr[-3000:]
    expected = " ".join("2" if s == "refused.py" else "0" for s in scripts)
    assert done.stdout.splitlines()[-1] == f"codes {expected}", done.stderr[-3000:]
    stray = stray_lines(done.stderr)
    assert not stray, f"{len(stray)} stray stderr line(s) in {2 * TIMES} exits:\n" + "\n".join(stray)

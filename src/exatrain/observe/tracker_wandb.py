"""Weights & Biases: one tracked run per run directory (`WandbRun`), offline unless told
otherwise, resumed under the same id; its `.wandb` logs read back (`read_wandb_log`) to learn
which steps a resumed run already holds; a short resumed segment (`wandb_segment`) to add files
to a finished run or end one left open."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .tracker_records import Outcome, scalar_summary


class WandbRun:
    name = "wandb"

    @staticmethod
    def key(name: str) -> str:
        return name

    def __init__(self, options, config: dict, run_dir: Path, tags: dict, group: str,
                 previous: dict | None):
        import wandb
        o = options.wandb
        previous = previous or {}
        self.mode = o.mode or os.environ.get("WANDB_MODE") or previous.get("mode") or "offline"
        self.id = previous.get("id") or new_id()
        self.project = previous.get("project") or o.project or os.environ.get("WANDB_PROJECT") \
            or "exatrain"
        self.entity = previous.get("entity") or o.entity or None
        self.run = wandb.init(
            project=self.project, entity=self.entity,
            name=o.name or os.environ.get("WANDB_NAME") or run_dir.name,
            group=o.group or os.environ.get("WANDB_RUN_GROUP") or group or None,
            tags=[f"{k}:{v}"[:64] for k, v in tags.items()] + list(o.tags),
            config=config, dir=str(run_dir), id=self.id, resume="allow", mode=self.mode,
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True, save_code=False,
                                    disable_git=True))
        self.dir = Path(self.run.dir).parent  # RUN_DIR/wandb/offline-run-DATE-ID

    @staticmethod
    def held(run_dir: Path, run_id: str) -> dict[str, int]:
        """{metric: last step} of what the run's earlier `.wandb` logs in RUN_DIR/wandb hold."""
        out: dict[str, int] = {}
        for log in sorted(run_dir.glob(f"wandb/*-{run_id}/run-{run_id}.wandb")):
            for record in read_wandb_log(log):
                if record.WhichOneof("record_type") == "history":
                    step = record.history.step.num
                    for item in record.history.item:
                        key = item.key or "/".join(item.nested_key)
                        if not key.startswith("_"):
                            out[key] = max(out.get(key, 0), step)
        return out

    def log(self, by_step: dict) -> None:
        for step, values in by_step.items():
            self.run.log(values, step=step)

    def finish(self, summary: dict | None, files: list[Path], run_dir: Path,
               end: Outcome) -> None:
        if summary is not None:
            self.run.summary.update(scalar_summary(summary))
        for path in files:  # the run's files directory is uploaded by `wandb sync`
            shutil.copy2(path, Path(self.run.dir) / path.name)
        if end.preempted:  # W&B shows it preempted, to be resumed (the same run id)
            self.run.mark_preempting()
        self.run.finish(exit_code=end.exit_code)

    def state(self) -> dict:
        return {"id": self.id, "mode": self.mode, "project": self.project, "entity": self.entity}

    def info(self) -> dict:
        out = {"run_id": self.id, "mode": self.mode, "dir": str(self.dir)}
        if self.mode == "offline":
            out["sync"] = f"wandb sync {self.dir}"
        return out


def wandb_segment(run_dir: Path, state: dict):
    """A short resumed segment of the W&B run `state` (trackers.json) names, in `run_dir`."""
    import wandb
    return wandb.init(project=state.get("project"), entity=state.get("entity"), id=state["id"],
                      resume="allow", mode=state.get("mode", "offline"), dir=str(run_dir),
                      reinit="create_new", settings=wandb.Settings(
                          console="off", silent=True, save_code=False, disable_git=True))


def read_wandb_log(path: Path) -> list:
    """The records of a W&B run's `.wandb` log: W&B's 7-byte header, then LevelDB-log blocks of
    32 KiB whose chunks (4-byte CRC, 2-byte length, 1-byte kind: full, first, middle, last) hold
    W&B's `Record` protobuf messages. A record cut short (a killed writer) ends the list."""
    import struct

    from wandb.proto import wandb_internal_pb2
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run log")
    pos, block, parts, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:          # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0 or pos + 7 + length > len(data):
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):                   # full, last: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


def new_id() -> str:
    """A W&B run id of the shape W&B makes: 8 lower-case letters and digits."""
    import secrets
    import string
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))

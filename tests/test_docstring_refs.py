"""Docstrings and comments name things that exist.

A backticked dotted name in src/exatrain that starts with one of exatrain's packages
(`train.step`, `observe.memory_meters.state_bytes`, `exatrain.optim.factory`) must resolve: to a
module, or to an attribute of one. Names that are not code are told apart by what they start
with: a config key (`train.target`, `observe.mlflow.tracking_uri`: a section of the default
config and a key of it, or the start of one such as `optim.kfac_`), a file name
(`train.h5`, `plan.py`), a member of the `Plan` or `Mesh` (`plan.space`, `mesh.axis`), or a
key of a workload's own [data] section (`data.parts`). A
module moved or renamed without its mentions fails here, naming the file and the stale name.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "exatrain"
PACKAGES = ("train", "parallel", "observe", "optim", "data", "comm", "tune", "population", "bench",
            "launch", "infer", "models", "workloads", "mesh", "plan", "errors")
NAME = re.compile(r"`((?:exatrain\.)?(?:%s)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)" % "|".join(PACKAGES))
FILE_SUFFIXES = ("h5", "bin", "py", "json", "jsonl", "toml", "log", "pt")


def resolves(name: str) -> bool:
    """Whether `exatrain.<name>` is a module or an attribute of one."""
    parts = ("exatrain." + name.removeprefix("exatrain.")).split(".")
    for i in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def is_config_key(name: str, config) -> bool:
    section, *keys = name.split(".")
    obj = getattr(config, section, None)
    if obj is None or not keys:
        return False
    for i, key in enumerate(keys):
        if hasattr(obj, key):
            obj = getattr(obj, key)
        elif i == len(keys) - 1 and key.endswith("_"):  # `optim.kfac_*`: a family of keys
            return any(k.startswith(key) for k in vars(obj))
        else:
            return False
    return True


def not_code(name: str, config) -> bool:
    from exatrain.mesh import Mesh
    from exatrain.plan import Plan

    head, _, rest = name.partition(".")
    if name.rsplit(".", 1)[-1] in FILE_SUFFIXES:
        return True
    if head == "plan" and hasattr(Plan(), rest.split(".")[0]):
        return True
    if head == "mesh" and (hasattr(Mesh, rest.split(".")[0])
                           or f"self.{rest.split('.')[0]} =" in (SRC / "mesh.py").read_text()):
        return True
    if head == "data" and rest in workload_data_keys():  # the [data] keys of every workload
        return True
    return is_config_key(name, config)


def workload_data_keys() -> set[str]:
    """The keys of every workload's [data] section (dataclass fields of workloads/*.py)."""
    keys = set()
    for path in (SRC / "workloads").glob("*.py"):
        keys.update(re.findall(r"^    ([a-z_][a-z0-9_]*): [^=]+=", path.read_text(), re.M))
    return keys


def stale_names() -> dict[str, list[str]]:
    from exatrain.train.config import load_config

    config = load_config()
    found: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for match in NAME.finditer(path.read_text()):
            name = match.group(1)
            if not resolves(name) and not not_code(name, config):
                found.setdefault(str(path.relative_to(SRC)), []).append(name)
    return found


def test_docstrings_name_modules_that_exist():
    stale = stale_names()
    assert not stale, f"names of modules or attributes that do not exist: {stale}"


def test_a_stale_module_name_is_found():
    config_free = "observe.memory_meters.state_bytes"
    assert resolves(config_free)
    assert not resolves("train.monitor.memory.state_bytes")  # where it lived before observe/

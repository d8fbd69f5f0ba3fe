"""MkDocs hook: the reference pages that are generated from the code, so they cannot drift.

* reference/config.md: every configuration key, from the config dataclasses (the fixed
  sections in exatrain.train.config.FIXED_SECTIONS and each built-in workload's ModelOptions and
  DataOptions): its type and default from the dataclass field, its meaning from the comment on
  (and continuing below, or the comment block just above) the field's line.
* reference/cli.md: `exatrain --help` and every subcommand's help, from cli.build_parser().

tests/test_docs.py checks that every field and every subcommand appears in what these return.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import os
import re

FIELD = re.compile(r"^(\s+)(\w+)\s*:\s*[^#]*?(?:#\s?(.*))?$")


def field_comments(cls) -> dict[str, str]:
    """{field: the comment that explains it} read from the dataclass's source."""
    lines = inspect.getsource(cls).splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    above: list[str] = []
    current, indent = None, 0
    for line in lines:
        stripped = line.strip()
        match = FIELD.match(line)
        if match and match.group(2) in names and not stripped.startswith("#"):
            current, indent = match.group(2), len(match.group(1))
            text = [*above, match.group(3) or ""]
            out[current] = " ".join(t.strip() for t in text if t.strip())
            above = []
        elif stripped.startswith("#"):
            depth = len(line) - len(line.lstrip())
            if current is not None and depth > indent:   # continues the comment of the field
                out[current] = (out[current] + " " + stripped.lstrip("# ").strip()).strip()
            else:
                above.append(stripped.lstrip("#").strip())
                current = None
        else:
            above, current = [], None
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def section_table(cls, section: str) -> str:
    comments = field_comments(cls)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append(f"| `{section}.{f.name}` | `{_cell(kind)}` | {_cell(_default(f))} | "
                    f"{_cell(comments.get(f.name, ''))} |")
    return "\n".join(rows)


def config_reference() -> str:
    from exatrain.train.config import FIXED_SECTIONS
    from exatrain.workloads import WORKLOAD_MODULES

    parts = ["# Configuration keys", "",
             "Generated from the configuration dataclasses when the site is built "
             "(`docs/hooks.py`), so it is what the code accepts. A TOML file sets any of these "
             "keys by section; `--set section.key=value` sets one on the command line (the "
             "value is read as TOML). A key that is not here is an error that names the closest "
             "valid one. How to use them: [Configure a run](../how-to/configure.md).", ""]
    for section, cls in FIXED_SECTIONS.items():
        doc = inspect.getdoc(cls) or ""
        parts += [f"## `[{section}]`", ""]
        if doc and not doc.startswith(cls.__name__ + "("):
            parts += [doc.split("\n\n")[0].replace("\n", " "), ""]
        parts += [f"Defined by `{cls.__module__}.{cls.__qualname__}`.", "", section_table(cls, section), ""]
    parts += ["## `[model]` and `[data]` of each built-in workload", "",
              "These sections belong to the workload named by `run.workload`. A user workload "
              "(`run.workload = \"module:function\"`) takes the keyword parameters of its build "
              "function and the fields of its `DataOptions` dataclass "
              "([Your own model](../tutorials/own-model.md)).", ""]
    for name, module_name in WORKLOAD_MODULES.items():
        module = importlib.import_module(module_name)
        summary = (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""
        parts += [f"### `{name}`", "", summary, ""]
        for section, cls in (("model", module.ModelOptions), ("data", module.DataOptions)):
            parts += [section_table(cls, section), ""]
    return "\n".join(parts)


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def cli_reference() -> str:
    from exatrain.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        parser = build_parser()
        parts = ["# Command line", "",
                 "Generated from `exatrain.cli.build_parser()` when the site is built, so it is "
                 "what `exatrain --help` prints.", "", "```text", parser.format_help().rstrip(),
                 "```", ""]
        for name, sub in _subparsers(parser):
            parts += [f"## `exatrain {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
            for inner, leaf in _subparsers(sub):
                parts += [f"### `exatrain {name} {inner}`", "", "```text",
                          leaf.format_help().rstrip(), "```", ""]
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(parts)


GENERATED = {"reference/config.md": config_reference, "reference/cli.md": cli_reference}


def on_files(files, config):
    from mkdocs.structure.files import File

    for path, make in GENERATED.items():
        files.append(File.generated(config, path, content=make()))
    return files

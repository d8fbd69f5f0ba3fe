"""MkDocs hook: the reference pages that are generated from the code, so they cannot drift.

* reference/config.md: every configuration key, from the config dataclasses (the fixed
  sections in exatrain.train.config.FIXED_SECTIONS and each built-in workload's ModelOptions and
  DataOptions): its type and default from the dataclass field, its meaning from the comment on
  (and continuing below, or the comment block just above) the field's line, inherited fields
  from their base class; NOT_IN_SOURCE holds the few meanings no comment gives yet.
* reference/cli.md: `exatrain --help` and every subcommand's help, from cli.build_parser().
* reference/errors.md (written by hand) gets, in place of its `<!-- user-errors -->` line, every
  subclass of exatrain.errors.UserError with what it means and what to do, from the classes'
  docstrings (errors_reference), so a new error cannot be left out.
* reference/summary.md: every figure of summary.json and metrics.jsonl, from the tables in
  exatrain.observe.fields (which the summary printer also formats by).
* concepts/plan.md's table of which axes compose: composition_table(), from the rules in
  exatrain.plan and exatrain.parallel.options; the page holds it (readable where the site is
  not built) and tests/test_docs.py fails when the two differ.
* developer/layout.md, the source layout: source_layout(), from the layer order (LAYERS in
  tests/test_import_graph.py, read as data, with the comment above each layer) and each
  package's `__init__` docstring. The page is committed (readable where the site is not built);
  `python docs/hooks.py layout` writes it, and tests/test_docs.py fails when it differs.

tests/test_docs.py checks that every field, with a meaning, and every subcommand appears in
what these return.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import os
import re
import typing
from pathlib import Path

FIELD = re.compile(r"^(\s+)(\w+)\s*:\s*[^#]*?(?:#\s?(.*))?$")


def _own_field_comments(cls) -> dict[str, str]:
    """{field: its comment} for the fields `cls` itself defines (not inherited), from its source.

    A field's meaning is the comment on its line, continued by deeper-indented comment lines
    below it. A comment block just above a field explains it too (the block, then the field's own
    comment); when the block heads a run of fields without comments of their own (no blank line
    between them), each of them takes the block's text.
    """
    names = set(getattr(cls, "__annotations__", {}))
    out: dict[str, str] = {}
    above: list[str] = []          # the comment block being read
    group = ""                     # the block over the current run of fields
    current, indent = None, 0
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        match = FIELD.match(line)
        if match and match.group(2) in names and not stripped.startswith("#"):
            current, indent = match.group(2), len(match.group(1))
            own = (match.group(3) or "").strip()
            if above:
                group = " ".join(above)
                out[current] = f"{group} {own}".strip()
            elif own:                  # a comment of its own ends the block's run
                out[current], group = own, ""
            else:
                out[current] = group
            above = []
        elif stripped.startswith("#"):
            depth = len(line) - len(line.lstrip())
            text = stripped.lstrip("#").strip()
            if current is not None and depth > indent:   # continues the comment of the field
                out[current] = f"{out[current]} {text}".strip()
            else:
                above.append(text)
                current = None
        else:
            above, group, current = [], "", None
    return out


def field_comments(cls) -> dict[str, str]:
    """{field: the comment that explains it} for every dataclass field of `cls`, inherited ones
    (e.g. a workload's DataOptions from InputOptions) from the class that defines them."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out.update({k: v for k, v in _own_field_comments(base).items() if v})
    return {f.name: out.get(f.name, "") for f in dataclasses.fields(cls)}


# Meanings of the fields whose source has no comment yet; the better home for each is a comment on
# its field (then delete it here). tests/test_docs.py fails when an entry names a field that no
# longer exists or now has a comment, and when any row of the page has no meaning at all.
NOT_IN_SOURCE = {
    "exatrain.population.options.PopulationOptions.lr_bounds":
        "[low, high]: a mutated learning rate is clipped into this range",
    "exatrain.population.options.PopulationOptions.weight_decay_bounds":
        "[low, high]: a mutated weight decay is clipped into this range",
    "exatrain.population.options.PopulationOptions.dropout_bounds":
        "[low, high]: a mutated dropout probability is clipped into this range",
    "exatrain.observe.options.MLPerfOptions.organization":
        "the submitter written as `submission_org` in mlperf.log",
    "exatrain.workloads.cosmoflow.ModelOptions.conv_layers":
        "convolution blocks, each halving the cube: model.size must divide by 2^conv_layers",
    "exatrain.workloads.cosmoflow.ModelOptions.dropout":
        "dropout probability in the dense head",
    "exatrain.workloads.cosmoflow.DataOptions.size":
        "cube edge of newly generated samples (must equal model.size)",
    "exatrain.workloads.cosmoflow.DataOptions.seed":
        "seed of the generated samples (sample i draws from its own stream of it)",
    "exatrain.workloads.deepcam.ModelOptions.aspp_rates":
        "small variant: dilation rates of the ASPP 3x3 branches (the reference has 6, 12, 18)",
    "exatrain.workloads.deepcam.DataOptions.height": "grid height of generated samples",
    "exatrain.workloads.deepcam.DataOptions.width": "grid width of generated samples",
    "exatrain.workloads.deepcam.DataOptions.channels": "input channels of generated samples",
    "exatrain.workloads.deepcam.DataOptions.seed": "seed of the generated data set",
    "exatrain.workloads.gcn.ModelOptions.hidden": "width of the hidden graph convolutions",
    "exatrain.workloads.gcn.ModelOptions.layers":
        "graph convolutions (features → hidden → … → classes)",
    "exatrain.workloads.gcn.ModelOptions.dropout": "dropout probability between graph convolutions",
    "exatrain.workloads.gcn.DataOptions.seed": "seed of the generated graph",
    "exatrain.workloads.gpt.ModelOptions.mlp_ratio": "MLP hidden width as a multiple of n_embd",
    "exatrain.workloads.gpt.ModelOptions.dropout":
        "dropout probability on attention weights and residual branches",
    "exatrain.workloads.gpt.ModelOptions.bias":
        "Linear and LayerNorm layers carry a bias (GPT-2: true)",
    "exatrain.workloads.gpt.ModelOptions.tie_weights": "share the token embedding with lm_head",
    "exatrain.workloads.gpt.DataOptions.val_fraction":
        "share of the generated corpus held out for validation (its contiguous end)",
    "exatrain.workloads.qm9.ModelOptions.cutoff":
        "Å: atoms farther apart share no edge; filters fall smoothly to zero there",
    "exatrain.workloads.qm9.DataOptions.val_molecules":
        "molecules held out for validation (the first of a seeded permutation)",
    "exatrain.workloads.qm9.DataOptions.seed":
        "seed of the permutation that splits train and validation",
    "exatrain.workloads.vit.ModelOptions.embed_dim": "token width",
    "exatrain.workloads.vit.ModelOptions.depth": "transformer blocks",
    "exatrain.workloads.vit.ModelOptions.num_heads":
        "attention heads per block; must divide embed_dim",
    "exatrain.workloads.vit.ModelOptions.mlp_ratio": "MLP hidden width as a multiple of embed_dim",
    "exatrain.workloads.vit.ModelOptions.dropout": "dropout probability in attention and MLP",
    "exatrain.workloads.vit.DataOptions.height": "grid height of the simulation",
    "exatrain.workloads.vit.DataOptions.width": "grid width of the simulation",
    "exatrain.workloads.vit.DataOptions.seed": "seed of the simulations' initial conditions",
    "exatrain.workloads.vit.DataOptions.val_fraction":
        "share of the trajectories held out for validation (at least one)",
}


def field_key(cls, name: str) -> str:
    return f"{cls.__module__}.{cls.__qualname__}.{name}"


def meanings(cls) -> dict[str, str]:
    """{field: meaning}: its comment in the source, else its entry in NOT_IN_SOURCE."""
    return {name: text or NOT_IN_SOURCE.get(field_key(cls, name), "")
            for name, text in field_comments(cls).items()}


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


def _rows(cls, section: str) -> list[str]:
    """A row per field; a field that is a table of its own ([observe.wandb]) is followed by its
    keys' rows."""
    comments, hints, rows = meanings(cls), typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rows.append(f"| `{section}.{f.name}` | table | `[{section}.{f.name}]` | "
                        f"{_cell(comments.get(f.name, ''))} |")
            rows += _rows(hints[f.name], f"{section}.{f.name}")
            continue
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append(f"| `{section}.{f.name}` | `{_cell(kind)}` | {_cell(_default(f))} | "
                    f"{_cell(comments.get(f.name, ''))} |")
    return rows


def section_table(cls, section: str) -> str:
    return "\n".join(["| key | type | default | meaning |", "|---|---|---|---|", *_rows(cls, section)])


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


def user_errors() -> list[type]:
    """Every subclass of exatrain.errors.UserError that exatrain defines (each module imported,
    so that none is missed), the base first, then each subtree in name order."""
    import pkgutil

    import exatrain
    from exatrain.errors import UserError

    for info in pkgutil.walk_packages(exatrain.__path__, "exatrain."):
        importlib.import_module(info.name)

    def tree(cls) -> list[type]:
        subs = sorted((c for c in cls.__subclasses__() if c.__module__.startswith("exatrain.")),
                      key=lambda c: c.__name__)
        return [cls] + [c for sub in subs for c in tree(sub)]
    return list(dict.fromkeys(tree(UserError)))


def meaning_and_fix(cls) -> tuple[str, str]:
    """A UserError's docstring split into what it means (the paragraphs before "What to do:")
    and what to do."""
    doc = inspect.getdoc(cls) if "__doc__" in vars(cls) else ""
    parts = [" ".join(p.split()) for p in (doc or "").split("\n\n") if p.strip()]
    fix = [p.removeprefix("What to do:").strip() for p in parts if p.startswith("What to do:")]
    return (" ".join(p for p in parts if not p.startswith("What to do:")), " ".join(fix))


ERRORS_MARKER = "<!-- user-errors -->"


def errors_reference() -> str:
    """The list that replaces ERRORS_MARKER in reference/errors.md."""
    from exatrain.errors import UserError

    parts = []
    for cls in user_errors():
        meaning, fix = meaning_and_fix(cls)
        bases = " and ".join(f"`{b.__name__}`" for b in cls.__bases__ if b is not Exception)
        parts += [f"### `{cls.__name__}`", "",
                  f"`{cls.__module__}.{cls.__qualname__}`" +
                  (f", a subclass of {bases}" if cls is not UserError else ""),
                  "", meaning, "", f"**What to do:** {fix}", ""]
    return "\n".join(parts)


def _field_table(rows) -> str:
    out = ["| key | unit | meaning | present |", "|---|---|---|---|"]
    for row in rows:
        out.append(f"| `{_cell(row.name)}` | {_cell(row.unit)} | {_cell(row.meaning)} | "
                   f"{_cell(row.when or 'always')} |")
    return "\n".join(out)


def summary_reference() -> str:
    from exatrain.observe.fields import METRICS, POPULATION, SUMMARY

    return "\n".join([
        "# Run summary and metrics", "",
        "Generated from the tables in `exatrain.observe.fields` when the site is built "
        "(`docs/hooks.py`); `exatrain run` formats its printed summary by the same units, and a "
        "test fails when a run writes a key that has no row here. A key written `<metric>` "
        "stands for a family: `val_<metric>` is `val_loss`, `val_mae`, `val_mae_H0`, and so on. "
        "How to read a run: [See what a run did](../how-to/observe.md).", "",
        "## summary.json", "",
        "Written to the run directory at the end of training (by rank 0), returned by "
        "`et.fit`, and printed by `exatrain run`. Byte figures without *whole job* are this "
        "rank's (rank 0's); `memory_per_rank` holds every rank's.", "",
        _field_table(SUMMARY), "",
        "### Population runs", "",
        "A run with `plan.trainer > 1` writes a summary of the whole population (each trainer's "
        "own summary.json is in `RUN_DIR/trainer_KK/`):", "",
        _field_table(POPULATION), "",
        "## metrics.jsonl", "",
        "One JSON object per line: a *training line* every `train.log_every` steps (figures of "
        "the interval since the last one) and an *evaluation line* every `train.eval_every` "
        "steps (`step` and the `val_<metric>` figures). The same numbers go to TensorBoard.", "",
        _field_table(METRICS), ""])


# The composition table of concepts/plan.md ("Which axes compose"): each pair of axes, as the
# rules in exatrain.plan.composition_refusal and exatrain.parallel.options.zero_stage_refusal
# decide it. The footnotes are prose on the page; which cell points to which is kept here.
COMPOSE_AXES = {"data": {"data": 2}, "shard": {"shard": 2}, "tensor 1D": {"tensor": 2},
                "tensor 3D": {"tensor": (1, 1, 2)}, "space": {"space": (1, 1, 2)},
                "pipe": {"pipe": 2}}
COMPOSE_LABELS = {("data", "shard"): "hybrid"}
COMPOSE_NOTES = {("shard", "tensor 1D"): "¹", ("shard", "tensor 3D"): "²", ("shard", "space"): "³",
                 ("shard", "pipe"): "⁴", ("tensor 1D", "space"): "⁵", ("tensor 3D", "space"): "⁵",
                 ("tensor 1D", "pipe"): "⁶", ("tensor 3D", "pipe"): "⁶", ("space", "pipe"): "⁷"}


def composition_cell(a: str, b: str) -> str:
    """`yes`, with the ZeRO stages that run where one axis is shard, or `refused`; a footnote."""
    from exatrain.parallel.options import zero_stage_refusal
    from exatrain.parallel.pipe.schedules import SCHEDULES
    from exatrain.plan import Plan, composition_refusal

    if a == b or {a, b} == {"tensor 1D", "tensor 3D"}:
        return "–"
    plan = Plan(**COMPOSE_AXES[a], **COMPOSE_AXES[b])
    note = COMPOSE_NOTES.get((a, b)) or COMPOSE_NOTES.get((b, a), "")
    if composition_refusal(plan) is not None:
        return f"refused{note}"
    details = [COMPOSE_LABELS.get((a, b)) or COMPOSE_LABELS.get((b, a))]
    if "shard" in (a, b):  # stages that run under every schedule, and those under some
        runs = {s: [name for name in SCHEDULES if zero_stage_refusal(plan, s, name) is None]
                for s in (1, 2, 3)}
        everywhere = [str(s) for s, ok in runs.items() if len(ok) == len(SCHEDULES)]
        details.append("ZeRO-" + ", ".join(everywhere))
        details += [f"ZeRO-{s} with {', '.join(ok)}" for s, ok in runs.items()
                    if 0 < len(ok) < len(SCHEDULES)]
    details = [d for d in details if d]
    return "yes" + (f" ({'; '.join(details)})" if details else "") + note


def composition_table() -> str:
    names = list(COMPOSE_AXES)
    rows = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        rows.append(f"| **{a}** | " + " | ".join(composition_cell(a, b) for b in names) + " |")
    return "\n".join(rows)


GENERATED = {"reference/config.md": config_reference, "reference/cli.md": cli_reference,
             "reference/summary.md": summary_reference}
GENERATED_IN_PAGE = {"reference/errors.md": (ERRORS_MARKER, errors_reference)}


def on_files(files, config):
    from mkdocs.structure.files import File

    for path, make in GENERATED.items():
        files.append(File.generated(config, path, content=make()))
    return files


def on_page_markdown(markdown, page, config, files):
    marker, make = GENERATED_IN_PAGE.get(page.file.src_uri, (None, None))
    if marker is None:
        return markdown
    if marker not in markdown:
        raise ValueError(f"{page.file.src_uri}: the line {marker} that docs/hooks.py fills is gone")
    return markdown.replace(marker, make())


# ---------------------------------------------------------------------- the source layout

ROOT = Path(__file__).resolve().parents[1]
LAYOUT_PAGE = "developer/layout.md"
LAYOUT_INTRO = """# Source layout

The packages of `src/exatrain`, in layers, lowest first. A module imports modules of its own layer
and of the layers below it, never of a layer above (function-level imports included), and no
import runs in a circle; `tests/test_import_graph.py` checks both on every test run. Where a lower
layer needs a value of a higher one, the higher one passes it in.

This page is generated from the layer order (`LAYERS` in `tests/test_import_graph.py`, with the
comment above each layer) and from each package's `__init__` docstring: run
`python docs/hooks.py layout` after changing either; `tests/test_docs.py` fails while the page
differs from what that writes.

Beside `src/`: `examples/` (one TOML per workload), `docs/` (this site; `docs/hooks.py` generates
the reference pages and this one), `tests/` (`harness.py` runs a function on N spawned gloo
ranks).
"""


def layers() -> list[tuple[str, str, tuple[str, ...]]]:
    """(layer, what it holds: the comment lines above it, its module prefixes), lowest first,
    read as data from tests/test_import_graph.py (not imported: the test file is the one place
    the order is written, beside the rule that checks it)."""
    path = ROOT / "tests" / "test_import_graph.py"
    text = path.read_text()
    lines = text.splitlines()
    for node in ast.parse(text).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "LAYERS":
            out = []
            for item in node.value.elts:
                name, prefixes = ast.literal_eval(item)
                comment, i = [], item.lineno - 2
                while i >= 0 and lines[i].strip().startswith("#"):
                    comment.insert(0, lines[i].strip().lstrip("#").strip())
                    i -= 1
                out.append((name, " ".join(comment), tuple(prefixes)))
            return out
    raise ValueError(f"{path}: no LAYERS = [...] to read the layer order from")


def _source(module: str) -> Path:
    """The file of a module or package of exatrain, by dotted name."""
    path = ROOT / "src" / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _docstring(path: Path) -> str:
    return (ast.get_docstring(ast.parse(path.read_text())) or "").strip()


def _package_entry(module: str) -> list[str]:
    """A package: its docstring (whole: several list their modules), its modules; then each
    subpackage the same way. A single module: the first paragraph of its docstring."""
    path = _source(module)
    shown = module.removeprefix("exatrain.").replace(".", "/")
    if path.name != "__init__.py":
        first = _docstring(path).split("\n\n")[0]
        return [f"**`{shown}.py`**: " + " ".join(first.split()), ""]
    folder = path.parent
    modules = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    out = [f"**`{shown}/`**", "", "```text", _docstring(path) or "(no docstring)", "```", ""]
    if modules:
        out += ["Modules: " + ", ".join(f"`{m}`" for m in modules) + ".", ""]
    for sub in sorted(p.parent for p in folder.glob("*/__init__.py")):
        out += _package_entry(f"{module}.{sub.name}")
    return out


def source_layout() -> str:
    """The whole page developer/layout.md, as `python docs/hooks.py layout` writes it."""
    out = [LAYOUT_INTRO]
    for number, (name, comment, prefixes) in enumerate(layers(), 1):
        out += [f"## {number}. {name}", "", f"*{comment}*" if comment else "", ""]
        if prefixes == ("exatrain",):  # the root package's own module: the public API
            first = _docstring(_source("exatrain")).split("\n\n")[0]
            out += ["**`__init__.py`** (`import exatrain as et`): " + " ".join(first.split()), ""]
            continue
        for prefix in prefixes:
            out += _package_entry(prefix)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["layout"]:
        sys.exit("usage: python docs/hooks.py layout   (writes docs/developer/layout.md)")
    (ROOT / "docs" / LAYOUT_PAGE).write_text(source_layout())
    print(f"wrote docs/{LAYOUT_PAGE}")

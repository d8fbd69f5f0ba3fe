"""The documentation cannot rot: every ```python block of every docs page and of the README runs,
and every ```toml block loads as an exatrain config, here, at the sizes written (kept tiny).

Per page, blocks run in order, in one namespace and one fresh working directory, as a reader who
pastes them one after the other would: a later block may use what an earlier one defined, and a
TOML block is loaded after the Python above it ran (so it can name the files and workloads they
made). Conventions:

* A block preceded by the line `<!-- docs-test: skip -->` (say why on the same line, after a
  colon, or in the text) is not run: one that needs GPUs, several ranks or a finished run.
* A Python block whose first line is `# NAME.py` is also saved as NAME.py and run as a script
  (`__name__ == "__main__"`), as the page tells the reader to do; `# NAME.py, continued` appends
  the block to that file (and runs it in the page's namespace).
* ```console, ```bash and ```text blocks are shell commands and output: not run.

The generated reference pages are checked too: every config key of every section and every
subcommand appears in what docs/hooks.py generates.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
SKIP = "<!-- docs-test: skip"
FENCE = re.compile(r"^([ \t]*)```(\w+)[^\n]*\n(.*?)^\1```[ \t]*$", re.S | re.M)  # also indented


@dataclasses.dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    skip: bool


def blocks_of(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
        out.append(Block(name, text.count("\n", 0, match.start()) + 1, match.group(2),
                         textwrap.dedent(match.group(3)), before.strip().startswith(SKIP)))
    return out


PAGES = sorted([*DOCS.rglob("*.md"), ROOT / "README.md"])
TESTED = [p for p in PAGES if any(b.lang in ("python", "toml") for b in blocks_of(p))]


def run_page(path: Path, workdir: Path, monkeypatch) -> int:
    """Run the page's python and toml blocks in order in `workdir`; returns how many ran."""
    from exatrain.train.config import load_config

    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))
    namespace = {"__name__": "__main__"}
    ran = 0
    for block in blocks_of(path):
        if block.lang not in ("python", "toml") or block.skip:
            continue
        where = f"{block.page}:{block.line}"
        if block.lang == "toml":
            config = workdir / f"block_{block.line}.toml"
            config.write_text(block.code)
            try:
                load_config(config)
            except Exception as exc:
                raise AssertionError(f"{where}: the TOML block is not a valid exatrain config: "
                                     f"{type(exc).__name__}: {exc}") from exc
        else:
            first = block.code.split("\n", 1)[0].strip()
            file = re.fullmatch(r"#\s*([\w/.-]+\.py)(,\s*continued)?", first)
            if file:
                target = workdir / file.group(1)
                if file.group(2):
                    target.write_text(target.read_text() + "\n\n" + block.code)
                else:
                    target.write_text(block.code)
                    namespace = {"__name__": "__main__", "__file__": str(target)}
            try:
                exec(compile(block.code, where, "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"{where}: the Python block failed: "
                                     f"{type(exc).__name__}: {exc}") from exc
        ran += 1
    return ran


@pytest.mark.parametrize("path", TESTED, ids=[str(p.relative_to(ROOT)) for p in TESTED])
def test_every_python_and_toml_block_runs(path, tmp_path, monkeypatch):
    assert run_page(path, tmp_path, monkeypatch) > 0 or all(
        b.skip for b in blocks_of(path) if b.lang in ("python", "toml"))


def test_the_harness_finds_blocks_and_honours_the_skip_marker(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n```python\nvalue = 6 * 7\n```\n\n<!-- docs-test: skip: 8 ranks -->\n"
                    "```python\nraise SystemExit('must not run')\n```\n\n```toml\n[train]\n"
                    "steps = 3\n```\n\n* in a list:\n\n    ```python\n    assert value == 42\n"
                    "    ```\n\n```console\nexatrain run\n```\n")
    assert [(b.lang, b.skip) for b in blocks_of(page)] == [
        ("python", False), ("python", True), ("toml", False), ("python", False), ("console", False)]
    (tmp_path / "run").mkdir()
    assert run_page(page, tmp_path / "run", monkeypatch) == 3
    page.write_text("```toml\n[train]\nstesp = 3\n```\n")
    with pytest.raises(AssertionError, match=r"page.md:1: the TOML block.*Did you mean 'steps'"):
        run_page(page, tmp_path / "run", monkeypatch)


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_reference_has_every_key_with_its_default():
    from exatrain.train.config import FIXED_SECTIONS
    from exatrain.workloads import WORKLOAD_MODULES, get_workload

    page = _hooks().config_reference()
    sections = {**{name: [cls] for name, cls in FIXED_SECTIONS.items()}}
    for name in WORKLOAD_MODULES:
        module = get_workload(name)
        sections.setdefault("model", []).append(module.ModelOptions)
        sections.setdefault("data", []).append(module.DataOptions)
    for section, classes in sections.items():
        for cls in classes:
            for f in dataclasses.fields(cls):
                assert f"| `{section}.{f.name}` |" in page, f"{section}.{f.name}"
    assert "| `train.steps` | `int` | `2000` | optimizer steps" in page
    assert "| `parallel.precision` | `str` | `\"fp32\"` | fp32 \\| bf16 \\| fp16" in page


def test_the_cli_reference_has_every_command():
    from exatrain.cli import build_parser

    page = _hooks().cli_reference()
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in commands:
        assert f"## `exatrain {name}`" in page
    assert "### `exatrain bench dp`" in page and "--nproc" in page


def test_the_readme_links_into_pages_that_exist():
    """The site's own links are checked by `mkdocs build --strict`; the README's here."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(((?:docs|examples)/[^)#]+)(?:#[^)]*)?\)", text)
    assert len(links) > 10
    for link in links:
        assert (ROOT / link).exists(), link
